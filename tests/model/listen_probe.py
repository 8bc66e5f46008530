"""Where a real torchrun run listens, seen from a network namespace of its own (run by
tests/model/test_torchrun_listen.py as `unshare -n sh -c '... exec python -m tests.model.listen_probe MODE'`).

The namespace has loopback and one more address, OTHER, on its lo: a store listening on every interface
answers there, one on 127.0.0.1 does not, which is what another machine would see of the run. Modes:
- `single`: `torchrun_command(..., 2)` (one node, two gloo ranks), then a plain torch TCPStore as the
  control (torch's own listens on every interface, so the probe must find it reachable from OTHER);
- `nodes`: two single-rank nodes that meet at OTHER:PORT with trusted_network;
- `rank DIR`: the torchrun target: join the process group, all-reduce, write DIR/ready-RANK, wait for DIR/stop.
Prints one JSON object: every listening TCP socket of the namespace while the ranks wait, and whether a
connection from OTHER to its port succeeds.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

OTHER = "192.0.2.10"  # TEST-NET-1: exists only on this namespace's lo
LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp


def listeners() -> list[tuple[str, int]]:
    """(address, port) of every listening TCP socket in this network namespace."""
    out = []
    for name, width in (("tcp", 8), ("tcp6", 32)):
        for line in Path(f"/proc/net/{name}").read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state == LISTEN:
                addr, port = local.split(":")
                out.append((_address(addr, width), int(port, 16)))
    return sorted(set(out))


def _address(hex_addr: str, width: int) -> str:
    raw = b"".join(bytes.fromhex(hex_addr[i : i + 8])[::-1] for i in range(0, width, 8))  # little-endian words
    return socket.inet_ntop(socket.AF_INET if width == 8 else socket.AF_INET6, raw)


def reachable(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex((host, port)) == 0


def snapshot() -> list[dict]:
    return [{"address": a, "port": p, "from_other": reachable(OTHER, p)} for a, p in listeners()]


def wait_for(paths: list[Path], procs: list[subprocess.Popen], timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        for proc in procs:
            if proc.poll() is not None:
                raise SystemExit(f"a launcher ended early: {proc.returncode}")
        if time.monotonic() > deadline:
            raise SystemExit("the ranks did not start")
        time.sleep(0.1)


def run(launches: list[list[str]], ranks: int, tmp: Path) -> list[dict]:
    procs = [subprocess.Popen(cmd) for cmd in launches]
    try:
        wait_for([tmp / f"ready-{r}" for r in range(ranks)], procs)
        seen = snapshot()
    finally:
        (tmp / "stop").touch()
        for proc in procs:
            proc.wait(timeout=120)
    return seen


def main(argv: list[str]) -> None:
    from model.training.distributed import new_run_id, torchrun_command

    mode, tmp = argv[0], Path(tempfile.mkdtemp())
    target = ["-m", "tests.model.listen_probe", "rank", str(tmp)]
    if mode == "single":
        result = {"run": run([torchrun_command(target, 2)], 2, tmp)}
        from torch.distributed import TCPStore

        control = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
        result["control"] = {"port": control.port, "from_other": reachable(OTHER, control.port)}
    else:
        with socket.socket() as s:
            s.bind((OTHER, 0))
            endpoint = f"{OTHER}:{s.getsockname()[1]}"
        run_id, launches = new_run_id(), []
        for rank in (0, 1):
            cmd = torchrun_command(target, 1, 2, rank, endpoint, run_id, trusted_network=True)
            # OTHER is not what this machine's name resolves to, so torchrun would not guess that node 0
            # hosts the store: say it (a real node's endpoint is its own address)
            launches.append(cmd[:3] + [f"--rdzv-conf=is_host={int(rank == 0)}"] + cmd[3:])
        result = {"run": run(launches, 2, tmp), "endpoint": endpoint}
    print(json.dumps(result))


def rank(directory: str) -> None:
    import torch
    import torch.distributed as dist

    from model.training.distributed import destroy, init

    d = init(torch.device("cpu"))
    dist.all_reduce(torch.ones(1))
    (Path(directory) / f"ready-{d.rank}").touch()
    while not (Path(directory) / "stop").exists():
        time.sleep(0.1)
    destroy()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if sys.argv[1] == "rank":
        rank(sys.argv[2])
    else:
        main(sys.argv[1:])
