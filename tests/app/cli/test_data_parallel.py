"""`bert pretrain|finetune --nproc-per-node N` (app/cli/launch.py over model/training/distributed.py and the trainer's
DDP): two gloo ranks on the CPU train as one process at the same global batch, two single-rank launchers
meet over loopback, a rank killed with SIGKILL ends the run and the same command resumes it to the same
weights, and bad launcher options are one-line errors: a rendezvous beyond loopback needs --trusted-network
(where the stores listen: tests/model/test_torchrun_listen.py).

The equality runs turn dropout off (hidden_dropout_prob = attention_probs_dropout_prob = 0): ranks draw
their own dropout masks, which one process cannot reproduce; everything else (data, masking, the loss
normalised by the global batch's label counts, the optimizer) is the same computation.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from app.cli import main
from app.cli.launch import strip_launch_options
from model.training.distributed import torchrun_command
from tests.conftest import make_training_files

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
STEPS = 50


def bert(*args, **kw):
    return subprocess.Popen(
        [sys.executable, "-m", "app.cli", *map(str, args)],
        env=ENV,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        **kw,
    )


def finished(proc, timeout=120):
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = make_training_files(tmp_path_factory.mktemp("ddp"))
    config = json.loads((root / "tiny.json").read_text())
    config.update(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    (root / "nodrop.json").write_text(json.dumps(config))
    return root


def args(root: Path, out: Path, *extra) -> list[str]:
    # NSP and MLM both: their losses are means over different counts (pairs, masked tokens).
    return [
        "pretrain",
        "--config",
        root / "nodrop.json",
        "--vocab",
        root / "vocab",
        "--corpus",
        root / "corpus.txt",
        "--batch-size",
        6,
        "--max-seq-len",
        32,
        "--eval-fraction",
        0,
        "--log-every",
        1,
        "--lr",
        1e-3,
        "--warmup",
        5,
        "--grad-accum",
        2,
        "--threads",
        1,
        "--max-steps",
        STEPS,
        "--save-every",
        10,
        "--out",
        out,
        *extra,
    ]


def losses(run: Path) -> list[float]:
    return [
        r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["type"] == "train"
    ]


def weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(run / "model" / "model.safetensors")


@pytest.fixture(scope="module")
def runs(files):
    """The same run on one process and on two ranks (started together: the machine has 2 cores)."""
    one, two = files / "one", files / "two"
    procs = [bert(*args(files, one)), bert(*args(files, two, "--nproc-per-node", 2))]
    for proc in procs:
        code, out, err = finished(proc)
        assert code == 0, err
        assert f"done: {STEPS} steps" in out
        assert "terminate called" not in err  # each rank left its process group before exiting
    return one, two


@pytest.mark.slow
def test_two_ranks_follow_the_single_process_loss_curve(runs):
    one, two = runs
    a, b = losses(one), losses(two)
    assert len(a) == len(b) == STEPS
    assert max(abs(x - y) / abs(x) for x, y in zip(a, b)) < 1e-4
    wa, wb = weights(one), weights(two)
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(wb[name], wa[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.slow
def test_rank_zero_writes_per_rank_throughput_and_the_world_size(runs):
    _, two = runs
    record = json.loads((two / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["world_size"] == 2 and len(record["rank_tokens_per_s"]) == 2
    assert record["tokens_per_s"] == pytest.approx(sum(record["rank_tokens_per_s"]))
    state = json.loads((two / "checkpoints" / f"step-{STEPS}" / "state.json").read_text())
    assert state["trainer"]["world_size"] == 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_nodes_on_loopback_match_one_process(runs, files):
    one, _ = runs
    out, endpoint = files / "nodes", f"127.0.0.1:{free_port()}"
    nodes = [
        bert(*args(files, out, "--nnodes", 2, "--node-rank", rank, "--rdzv-endpoint", endpoint, "--rdzv-id", "run-1"))
        for rank in (0, 1)
    ]
    for node in nodes:
        code, _, err = finished(node)
        assert code == 0, err
    a, b = losses(one), losses(out)
    assert max(abs(x - y) / abs(x) for x, y in zip(a, b)) < 1e-4 and len(b) == STEPS


def descendants(pid: int) -> list[int]:
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return []
    return [d for c in map(int, children) for d in (c, *descendants(c))]


def rank_pid(launcher: int, rank: int) -> int | None:
    for pid in descendants(launcher):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and any(e.startswith(b"LOCAL_RANK=") for e in env):
            return pid
    return None


@pytest.mark.slow
def test_a_killed_rank_ends_the_run_and_the_same_command_resumes_to_the_same_weights(runs, files):
    _, two = runs
    out = files / "killed"
    launcher = bert(*args(files, out, "--nproc-per-node", 2))
    deadline = time.monotonic() + 60
    while not (out / "checkpoints" / "step-10" / "COMPLETE").exists():
        assert launcher.poll() is None and time.monotonic() < deadline, "the run ended before its first checkpoint"
        time.sleep(0.01)
    os.kill(rank_pid(launcher.pid, 1), signal.SIGKILL)
    code, _, err = finished(launcher)
    assert code != 0
    assert "a training process failed (torchrun exit status" in err and "Run the same command to resume." in err
    assert not (out / "model").exists()
    assert not descendants(launcher.pid)

    code, stdout, err = finished(bert(*args(files, out, "--nproc-per-node", 2)))
    assert code == 0, err
    assert "resuming from" in err and f"done: {STEPS} steps" in stdout
    wa, wb = weights(two), weights(out)
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--nproc-per-node", "0"], "--nproc-per-node must be an integer >= 1, got 0"),
        (["--nnodes", "2"], "2 nodes need a rendezvous endpoint HOST:PORT (the same on every node)"),
        (
            ["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:1"],
            "--node-rank must be in [0, 2) for 2 node(s), got 2",
        ),
        (["--nnodes", "2", "--rdzv-endpoint", "nohost"], "rendezvous endpoint must be HOST:PORT, got 'nohost'"),
        (
            ["--nnodes", "2", "--rdzv-endpoint", "10.0.0.1:29400"],
            "rendezvous endpoint 10.0.0.1:29400 is not on "
            "loopback: torch's rendezvous store runs code sent to its port, so a multi-node run needs a network that only "
            "the training nodes can reach; say so with --trusted-network",
        ),
        (
            ["--nnodes", "2", "--rdzv-endpoint", "node0.example:29400", "--node-rank", "1", "--rdzv-id", "x"],
            "rendezvous endpoint node0.example:29400 is not on loopback: torch's rendezvous store runs code sent to its "
            "port, so a multi-node run needs a network that only the training nodes can reach; say so with "
            "--trusted-network",
        ),
        (
            ["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29400", "--node-rank", "1"],
            "--node-rank 1 needs the run's --rdzv-id: the one node 0 printed (the same on every node)",
        ),
        (
            ["--nnodes", "2", "--rdzv-endpoint", "h:1", "--trusted-network", "--rdzv-id", "a b"],
            "--rdzv-id must be 1 to 128 letters, digits, '-', '_' or '.', got 'a b'",
        ),
        (
            ["--nproc-per-node", "2", "--device", "cuda:1"],
            "--device cuda:1 names one GPU, but --nproc-per-node 2 "
            "gives each process its own (cuda:LOCAL_RANK): use --device cuda",
        ),
    ],
)
def test_bad_launcher_options_are_one_line_errors(tmp_path, capsys, extra, message):
    assert main(["finetune", "--train", "x.csv", "--from", "m", "--out", str(tmp_path), *extra]) == 2
    assert capsys.readouterr().err == f"bert finetune: error: {message}\n"


def test_the_ranks_run_the_same_command_without_the_launcher_options():
    argv = [
        "pretrain",
        "--corpus",
        "c",
        "--nproc-per-node",
        "2",
        "--nnodes=2",
        "--node-rank",
        "1",
        "--rdzv-endpoint=h:29500",
        "--trusted-network",
        "--rdzv-id",
        "r1",
        "--out",
        "r",
    ]
    assert strip_launch_options(argv) == ["pretrain", "--corpus", "c", "--out", "r"]
    assert torchrun_command(["-m", "app.cli", "pretrain"], 2, python="py") == [
        "py",
        "-m",
        "model.training.torchrun",
        "--nproc-per-node=2",
        "--max-restarts=0",
        "--standalone",
        "--local-addr=127.0.0.1",
        "-m",
        "app.cli",
        "pretrain",
    ]
    assert torchrun_command(["x.py"], 1, 2, 1, "h:29500", "r1", trusted_network=True, python="py")[3:] == [
        "--nproc-per-node=1",
        "--max-restarts=0",
        "--nnodes=2",
        "--node-rank=1",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=h:29500",
        "--rdzv-id=r1",
        "x.py",
    ]
    assert torchrun_command(["x.py"], 1, 2, 0, "127.0.0.1:29500", "r1", python="py")[-2:] == [
        "--local-addr=127.0.0.1",
        "x.py",
    ]


def test_node_zero_prints_a_random_run_id_and_the_risk_of_a_trusted_network_once(files):
    """In a network namespace of its own (nothing it sends leaves the machine), stopped once it has said so:
    no other node comes to meet it."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root and unshare for a network namespace")
    command = args(files, files / "trusted", "--nnodes", 2, "--rdzv-endpoint", "192.0.2.1:29400", "--trusted-network")
    launcher = subprocess.Popen(
        ["unshare", "-n", sys.executable, "-m", "app.cli", *map(str, command)],
        env=ENV,
        text=True,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    lines = []
    try:
        while not lines or not lines[-1].startswith("data parallel:"):
            lines.append(launcher.stderr.readline())
            assert lines[-1], "".join(lines)
    finally:
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()
    run_id = lines[0].split()[2]
    assert len(run_id) == 32 and int(run_id, 16) >= 0
    assert lines == [
        f"rendezvous id: {run_id} (start the other nodes with --rdzv-id {run_id})\n",
        "warning: --trusted-network: the rendezvous store on 192.0.2.1:29400 runs code sent to its "
        "port; only the training nodes must be able to reach it\n",
        "data parallel: 1 process(es) x 2 node(s) through torchrun\n",
    ]


@pytest.mark.slow
def test_ctrl_c_stops_every_rank_at_one_step_with_a_checkpoint(files):
    out = files / "interrupted"
    launcher = bert(*args(files, out, "--nproc-per-node", 2, "--max-steps", 100_000), start_new_session=True)
    deadline = time.monotonic() + 60
    while not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text():
        assert launcher.poll() is None and time.monotonic() < deadline, "training did not start"
        time.sleep(0.05)
    os.killpg(launcher.pid, signal.SIGINT)  # as the terminal sends Ctrl-C: to the launcher, torchrun and ranks
    code, stdout, err = finished(launcher)
    assert code == 130, err
    step = int(stdout.split("stopped at step ")[1].split("/")[0])
    assert (out / "checkpoints" / f"step-{step}" / "COMPLETE").is_file()
    assert err.count("stopping after this step (a checkpoint is saved)") == 2  # one line per rank
    assert "Traceback" not in err
