"""Data-parallel training under torchrun: the process group, this process's rank, and the few collectives
the trainer needs.

`python -m torch.distributed.run` (torchrun) starts one process per rank and gives each RANK, WORLD_SIZE,
LOCAL_RANK and MASTER_ADDR/PORT in its environment; `init()` reads them and joins the group (gloo on CPU,
NCCL on CUDA). Without them everything here is the single-process case: rank 0 of 1, no collectives.

How a global micro-batch is shared (model/training/trainer.py): every rank reads the same global micro-batch (a
pure function of (seed, epoch, batch index)) and keeps its own rows, `rank::world`. A loss is a mean over
its own labels (masked tokens for MLM, rows for NSP and classification), which differ in number between
ranks, so each rank's mean is weighted by `world * local_count / global_count` (`loss_weights`): DDP then
averages the gradients over ranks, and the result is the gradient of the global micro-batch's mean, the
same as one process computing it. DDP is PyTorch's DistributedDataParallel (Li et al. 2020, "PyTorch
Distributed: Experiences on Accelerating Data Parallel Training"); torchrun is torch.distributed.elastic.

Where the run listens (`listen_where_named`). torch's TCPStore server listens on every interface whatever
host it is given, and torchrun unpickles the rendezvous state it reads from it: anyone who reaches the
port runs code in the launcher. Here a store listens on the address its host name resolves to and nowhere
else: one node's run on loopback only (its rendezvous, its ranks' master store, gloo's sockets), several
nodes' on the rendezvous endpoint's address, which `check_launch` accepts only on loopback unless the
network is declared trusted; several nodes meet under a random run id by default, so the store's keys
cannot be guessed either.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import ipaddress
import os
import secrets
import signal
import socket
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from model.modeling import IGNORE_INDEX

# Which batch key holds the labels a loss is a mean over; others are a mean over the batch's rows.
LOSS_LABELS = {"loss": "labels", "mlm_loss": "labels", "nsp_loss": "next_sentence_label"}
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


@dataclass(frozen=True)
class Dist:
    """This process's place in the run: rank `rank` of `world` (1 when not launched by torchrun)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launched() -> bool:
    """True in a process that torchrun started (it sets WORLD_SIZE, RANK and LOCAL_RANK)."""
    return all(k in os.environ for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK"))


def env_dist() -> Dist:
    if not launched():
        return Dist()
    return Dist(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"]))


def init(device: torch.device, timeout_s: float = 1800.0) -> Dist:
    """Join torchrun's process group (once) if this process is one of its ranks; returns where it stands.

    A rank dies with its launcher (PR_SET_PDEATHSIG), so killing torchrun, or the worker process that
    started it, never leaves ranks training on their own."""
    d = env_dist()
    if not d.enabled:
        return d
    if not dist.is_initialized():
        die_with_parent()
        listen_where_named()  # rank 0 hosts the master store itself if torchrun's agent does not
        if is_loopback(os.environ.get("MASTER_ADDR", "")) and sys.platform == "linux":
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # every rank is here: gloo's sockets too
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":  # before the group exists, so NCCL's first collective uses this rank's GPU
            torch.cuda.set_device(d.local_rank)
        # device_id binds the group to this rank's GPU (NCCL connects eagerly, no guessing from the current device)
        bound = torch.device("cuda", d.local_rank) if device.type == "cuda" else None
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), device_id=bound)
    if dist.get_world_size() != d.world or dist.get_rank() != d.rank:
        raise RuntimeError(
            f"process group is rank {dist.get_rank()} of {dist.get_world_size()}, "
            f"but the environment says {d.rank} of {d.world}"
        )
    return d


def rank_device(device: torch.device, d: Dist) -> torch.device:
    """On CUDA each rank of a node takes its own GPU, cuda:LOCAL_RANK (torchrun's convention)."""
    if device.type == "cuda" and d.enabled:
        torch.cuda.set_device(d.local_rank)
        return torch.device("cuda", d.local_rank)
    return device


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask Linux to send `sig` to this process when its parent exits (no-op elsewhere)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent was already gone before prctl: nobody will signal us
        os.kill(os.getpid(), sig)


def barrier(d: Dist) -> None:
    if d.enabled:
        dist.barrier()


def all_reduce_sum(values: torch.Tensor, d: Dist) -> torch.Tensor:
    """Element-wise sum over ranks of a small float64 CPU tensor (gloo; on NCCL it travels via the GPU)."""
    if not d.enabled:
        return values
    if dist.get_backend() == "nccl":
        on_gpu = values.to(torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(on_gpu)
        return on_gpu.cpu()
    dist.all_reduce(values)
    return values


def all_reduce_in_place(values: torch.Tensor, d: Dist) -> torch.Tensor:
    """`values` summed over ranks where it lives (a CUDA tensor with NCCL, a CPU one with gloo), never read: with
    NCCL the reduction is queued on the GPU's stream, and nothing on the host waits for it."""
    if d.enabled:
        dist.all_reduce(values)
    return values


def any_rank(flag: bool, d: Dist) -> bool:
    """True on every rank when `flag` is True on any: a stop request reaches all ranks at the same step."""
    if not d.enabled:
        return flag
    return bool(all_reduce_sum(torch.tensor([float(flag)], dtype=torch.float64), d)[0] > 0)


def same_on_all_ranks(value: float, d: Dist) -> bool:
    """True on every rank when every rank holds the same `value` (all equal iff W * sum(v^2) == sum(v)^2)."""
    if not d.enabled:
        return True
    total, squares = all_reduce_sum(torch.tensor([value, value * value], dtype=torch.float64), d).tolist()
    return abs(d.world * squares - total * total) <= 1e-9 * max(1.0, total * total)


def rank_rows(batch: dict[str, torch.Tensor], d: Dist) -> tuple[dict[str, torch.Tensor], float]:
    """This rank's rows of a global batch, `rank::world`, and the factor its losses take (1, or 0 when the
    batch has fewer rows than ranks and this rank has none: it then runs row 0 so DDP's all-reduce still
    gets its gradients, which the zero factor makes nothing)."""
    if not d.enabled:
        return batch, 1.0
    rows = len(next(iter(batch.values())))
    if d.rank >= rows:
        return {k: v[:1] for k, v in batch.items()}, 0.0
    return {k: v[d.rank :: d.world] for k, v in batch.items()}, 1.0


def label_counts(batch: dict[str, torch.Tensor], names) -> dict[str, int]:
    """How many labels each loss in `names` is a mean over in `batch`: integer labels other than -100 for
    per-token labels (MLM, token classification), rows otherwise (NSP, classification, regression)."""
    counts = {}
    for name in names:
        labels = batch.get(LOSS_LABELS.get(name, "labels"))
        if labels is None:
            counts[name] = len(next(iter(batch.values())))
        elif labels.dim() >= 2 and not labels.is_floating_point():
            counts[name] = int((labels != IGNORE_INDEX).sum())
        else:
            counts[name] = labels.shape[0]
    return counts


def loss_weights(
    global_batch: dict[str, torch.Tensor], local_batch: dict[str, torch.Tensor], names, d: Dist, factor: float = 1.0
) -> dict[str, float]:
    """Per loss: world * local_count / global_count, so that DDP's gradient average equals the gradient of
    the global batch's mean (see the module docstring). 1.0 for each when not distributed."""
    if not d.enabled:
        return dict.fromkeys(names, 1.0)
    total, local = label_counts(global_batch, names), label_counts(local_batch, names)
    return {name: factor * d.world * local[name] / max(1, total[name]) for name in names}


def rank_seed(seed: int, step: int, rank: int) -> int:
    """The dropout seed of `rank` at optimizer step `step`: every rank draws its own masks, and a run
    resumed at any step draws the same ones as an uninterrupted run, with no per-rank RNG state to save."""
    return (seed * 1_000_003 + step * 8_191 + rank * 131 + 1) % (2**63 - 1)


# What gloo and NCCL say when another rank is gone; from inside DDP's backward they arrive as plain RuntimeError.
_PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "gloo", "NCCL")


def is_peer_failure(error: BaseException) -> bool:
    """True for an error that says another rank failed (a collective lost its peer), not this rank's own
    problem: the run should end as "a process died" and be resumed, not be judged a failure of the job."""
    if isinstance(error, dist.DistError):
        return True
    return isinstance(error, RuntimeError) and any(s in str(error) for s in _PEER_GONE)


def destroy() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def main_first(device: torch.device):
    """Rank 0 runs the block first (building token caches, learning a vocabulary), then the others, which
    find its files; joins the process group to do so. One process: just the block."""
    d = init(device)
    if not d.is_main:
        barrier(d)
    yield d
    if d.is_main:
        barrier(d)


def torchrun_command(
    target: list[str],
    nproc_per_node: int,
    nnodes: int = 1,
    node_rank: int = 0,
    rdzv_endpoint: str | None = None,
    rdzv_id: str | None = None,
    trusted_network: bool = False,
    python: str = sys.executable,
) -> list[str]:
    """The command that runs `target` (e.g. ["-m", "app.cli", "pretrain", ...]) on `nproc_per_node` ranks
    here, through torchrun (model/training/torchrun.py: torch.distributed.run, dying with its parent, its stores
    listening where `listen_where_named` says). One node: --standalone (a local rendezvous on a free port,
    a random run id), this node's address 127.0.0.1, so every store is on loopback. Several: the c10d
    rendezvous at `rdzv_endpoint` under `rdzv_id` (the same on every node; see check_launch).
    --max-restarts 0: a rank that dies ends the run (the others are stopped), to be resumed from its latest
    checkpoint."""
    check_launch(nproc_per_node, nnodes, node_rank, rdzv_endpoint, rdzv_id, trusted_network)
    cmd = [python, "-m", "model.training.torchrun", f"--nproc-per-node={nproc_per_node}", "--max-restarts=0"]
    if nnodes == 1:
        cmd += ["--standalone", "--local-addr=127.0.0.1"]
    else:
        cmd += [
            f"--nnodes={nnodes}",
            f"--node-rank={node_rank}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={rdzv_endpoint}",
            f"--rdzv-id={rdzv_id}",
        ]
        assert rdzv_endpoint is not None  # check_launch asks for one with nnodes > 1
        if is_loopback(endpoint_host(rdzv_endpoint)):  # every node is on this machine
            cmd.append("--local-addr=127.0.0.1")
    return cmd + list(target)


def check_launch(
    nproc_per_node: int,
    nnodes: int = 1,
    node_rank: int = 0,
    rdzv_endpoint: str | None = None,
    rdzv_id: str | None = None,
    trusted_network: bool = False,
) -> None:
    """ValueError quoting the values for launcher options that cannot work, or that would open the
    rendezvous store to a network not declared trusted (see the module docstring)."""
    if not isinstance(nproc_per_node, int) or nproc_per_node < 1:
        raise ValueError(f"nproc_per_node must be an integer >= 1, got {nproc_per_node!r}")
    if not isinstance(nnodes, int) or nnodes < 1:
        raise ValueError(f"nnodes must be an integer >= 1, got {nnodes!r}")
    if not isinstance(node_rank, int) or not 0 <= node_rank < nnodes:
        raise ValueError(f"node_rank must be in [0, {nnodes}) for {nnodes} node(s), got {node_rank!r}")
    if nnodes > 1 and not rdzv_endpoint:
        raise ValueError(f"{nnodes} nodes need a rendezvous endpoint HOST:PORT (the same on every node)")
    if rdzv_endpoint is not None:
        host, _, port = rdzv_endpoint.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"rendezvous endpoint must be HOST:PORT, got {rdzv_endpoint!r}")
    if nnodes > 1 and rdzv_endpoint and not trusted_network and not is_loopback(endpoint_host(rdzv_endpoint)):
        raise ValueError(
            f"rendezvous endpoint {rdzv_endpoint} is not on loopback: torch's rendezvous store runs "
            "code sent to its port, so a multi-node run needs a network that only the training "
            "nodes can reach; say so with trusted_network"
        )
    if rdzv_id is not None and not (0 < len(rdzv_id) <= 128 and all(c.isalnum() or c in "-_." for c in rdzv_id)):
        raise ValueError(f"rdzv_id must be 1 to 128 letters, digits, '-', '_' or '.', got {rdzv_id!r}")
    if nnodes > 1 and node_rank > 0 and rdzv_id is None:
        raise ValueError(
            f"node_rank {node_rank} needs the run's rdzv_id: the one node 0 printed (the same on every node)"
        )


def new_run_id() -> str:
    """A rendezvous run id nobody can guess (torchrun's default, "none", names a known store key)."""
    return secrets.token_hex(16)


def endpoint_host(endpoint: str) -> str:
    """HOST of HOST:PORT, without the brackets of an IPv6 literal."""
    return endpoint.rpartition(":")[0].strip("[]")


def is_loopback(host: str) -> bool:
    """True for localhost and loopback addresses (127.0.0.0/8, ::1); no name lookup."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def listen_address(host: str, port: int) -> tuple[int, tuple]:
    """(family, sockaddr) a store named `host` listens on: the name's first IPv4 address, else its first."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    family, _, _, _, address = min(infos, key=lambda info: info[0] != socket.AF_INET)
    return family, address


class _NamedAddressStore(dist.TCPStore):
    """A TCPStore whose server listens on the address its host name resolves to (torch's listens on every
    interface): the server is handed a socket bound there (TCPStore's master_listen_fd)."""

    def __init__(
        self,
        host_name: str,
        port: int,
        world_size: int | None = None,
        is_master: bool = False,
        timeout: datetime.timedelta = datetime.timedelta(seconds=300),
        wait_for_workers: bool = True,
        multi_tenant: bool = False,
        master_listen_fd: int | None = None,
        use_libuv: bool | None = None,
    ):
        if is_master and master_listen_fd is None:
            master_listen_fd, port = _bound_socket(host_name, port)
        options = {} if use_libuv is None else {"use_libuv": use_libuv}
        super().__init__(
            host_name, port, world_size, is_master, timeout, wait_for_workers, multi_tenant, master_listen_fd, **options
        )


def _bound_socket(host: str, port: int) -> tuple[int, int]:
    """A listening socket's descriptor (handed over: the store closes it) and its port."""
    try:
        family, address = listen_address(host, port)
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError as e:
        raise RuntimeError(f"cannot listen on {host}:{port}: {e}") from e
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
    except OSError as e:  # RuntimeError, as torch's own: c10d's rendezvous then joins as a client instead
        sock.close()
        raise RuntimeError(f"cannot listen on {host}:{port}: {e}") from e
    port = sock.getsockname()[1]
    return sock.detach(), port


def listen_where_named() -> None:
    """Make every TCPStore server this process starts (torchrun's rendezvous and agent stores, a rank's
    master store) listen on its host name's address only. Patches the names torch's launcher and
    init_process_group create stores by; idempotent."""
    import torch.distributed.elastic.rendezvous.c10d_rendezvous_backend as c10d_backend
    import torch.distributed.elastic.rendezvous.static_tcp_rendezvous as static_backend
    import torch.distributed.rendezvous as rendezvous

    for module in (dist, rendezvous, c10d_backend, static_backend):
        if (store := getattr(module, "TCPStore", None)) is not None and store is not _NamedAddressStore:
            vars(module)["TCPStore"] = _NamedAddressStore  # (by name: the loop's modules are typed as ModuleType)
