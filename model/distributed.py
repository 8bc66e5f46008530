"""Data-parallel training under torchrun: the process group, this process's rank, and the few collectives
the trainer needs.

`python -m torch.distributed.run` (torchrun) starts one process per rank and gives each RANK, WORLD_SIZE,
LOCAL_RANK and MASTER_ADDR/PORT in its environment; `init()` reads them and joins the group (gloo on CPU,
NCCL on CUDA). Without them everything here is the single-process case: rank 0 of 1, no collectives.

How a global micro-batch is shared (model/trainer.py): every rank reads the same global micro-batch (a
pure function of (seed, epoch, batch index)) and keeps its own rows, `rank::world`. A loss is a mean over
its own labels (masked tokens for MLM, rows for NSP and classification), which differ in number between
ranks, so each rank's mean is weighted by `world * local_count / global_count` (`loss_weights`): DDP then
averages the gradients over ranks, and the result is the gradient of the global micro-batch's mean, the
same as one process computing it. DDP is PyTorch's DistributedDataParallel (Li et al. 2020, "PyTorch
Distributed: Experiences on Accelerating Data Parallel Training"); torchrun is torch.distributed.elastic.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import os
import signal
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

IGNORE_INDEX = -100  # labels that take no part in a loss (HF's and ours)
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
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":  # before the group exists, so NCCL's first collective uses this rank's GPU
            torch.cuda.set_device(d.local_rank)
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    if dist.get_world_size() != d.world or dist.get_rank() != d.rank:
        raise RuntimeError(f"process group is rank {dist.get_rank()} of {dist.get_world_size()}, "
                           f"but the environment says {d.rank} of {d.world}")
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
    return {k: v[d.rank::d.world] for k, v in batch.items()}, 1.0


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


def loss_weights(global_batch: dict[str, torch.Tensor], local_batch: dict[str, torch.Tensor], names,
                 d: Dist, factor: float = 1.0) -> dict[str, float]:
    """Per loss: world * local_count / global_count, so that DDP's gradient average equals the gradient of
    the global batch's mean (see the module docstring). 1.0 for each when not distributed."""
    if not d.enabled:
        return {name: 1.0 for name in names}
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


def torchrun_command(target: list[str], nproc_per_node: int, nnodes: int = 1, node_rank: int = 0,
                     rdzv_endpoint: str | None = None, python: str = sys.executable) -> list[str]:
    """The command that runs `target` (e.g. ["-m", "app.cli", "pretrain", ...]) on `nproc_per_node` ranks
    here, through torchrun (model/torchrun.py: torch.distributed.run, dying with its parent). One node:
    --standalone (a local rendezvous on a free port); several: the c10d rendezvous at `rdzv_endpoint`.
    --max-restarts 0: a rank that dies ends the run (the others are stopped), to be resumed from its
    latest checkpoint."""
    check_launch(nproc_per_node, nnodes, node_rank, rdzv_endpoint)
    cmd = [python, "-m", "model.torchrun", f"--nproc-per-node={nproc_per_node}", "--max-restarts=0"]
    if nnodes == 1:
        cmd.append("--standalone")
    else:
        cmd += [f"--nnodes={nnodes}", f"--node-rank={node_rank}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={rdzv_endpoint}"]
    return cmd + list(target)


def check_launch(nproc_per_node: int, nnodes: int = 1, node_rank: int = 0, rdzv_endpoint: str | None = None) -> None:
    """ValueError quoting the values for launcher options that cannot work."""
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
