"""`bert pretrain|finetune --nproc-per-node N [--nnodes M --node-rank R --rdzv-endpoint HOST:PORT --rdzv-id ID
--trusted-network]`: the same command again, under torchrun.

The command re-runs itself as `python -m model.training.torchrun ... -m app.cli pretrain ...` (torch.distributed.run,
model/training/distributed.py: torchrun_command) with the same arguments minus these; each rank then finds
RANK/WORLD_SIZE in its environment and the trainer goes data-parallel (model/training/trainer.py). This process
only waits: Ctrl-C reaches the ranks from the terminal (they stop after the step, with a checkpoint), a
SIGTERM sent to it alone is passed on to torchrun, and a rank that dies ends the run with one line saying
how to resume. Several nodes meet on loopback unless --trusted-network says the network between them
is private (torch's rendezvous store runs what it is sent; the risk is printed once), under a random run
id that node 0 prints unless --rdzv-id names one. Reference: https://pytorch.org/docs/stable/elastic/run.html
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys

from model.errors import UserError

# model.training.distributed and model.training.checkpoint (torch) load when a command runs, not when `bert` parses its options.

LAUNCH_OPTIONS = ("--nproc-per-node", "--nnodes", "--node-rank", "--rdzv-endpoint", "--rdzv-id")  # with a value
LAUNCH_FLAGS = ("--trusted-network",)
# check_launch's parameter names as this command spells them
OPTION_NAMES = {
    "nproc_per_node": "--nproc-per-node",
    "nnodes": "--nnodes",
    "node_rank": "--node-rank",
    "rdzv_id": "--rdzv-id",
    "trusted_network": "--trusted-network",
}


def add_launch_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data parallel (torchrun)")
    g.add_argument(
        "--nproc-per-node",
        type=int,
        default=1,
        metavar="N",
        help="processes on this machine, one per GPU on CUDA (gloo on CPU, NCCL on CUDA; default 1)",
    )
    g.add_argument("--nnodes", type=int, default=1, metavar="M", help="machines in the run (default 1)")
    g.add_argument("--node-rank", type=int, default=0, metavar="R", help="this machine's rank, 0 to M-1")
    g.add_argument(
        "--rdzv-endpoint",
        metavar="HOST:PORT",
        help="with --nnodes > 1: where the machines meet (the same on every one; c10d rendezvous); "
        "its port must be reachable only from the training machines (default: none; needed "
        "with --nnodes > 1)",
    )
    g.add_argument(
        "--rdzv-id",
        metavar="ID",
        help="with --nnodes > 1: the run's rendezvous id, the same on every machine (default: node 0 "
        "makes a random one and prints it; the other nodes need it)",
    )
    g.add_argument(
        "--trusted-network",
        action="store_true",
        help="allow a --rdzv-endpoint beyond loopback: the network between the machines is private "
        "(torch's rendezvous store runs code sent to its port)",
    )


def wants_launcher(args: argparse.Namespace) -> bool:
    """True when the options ask for several processes and this process is not already one of them."""
    from model.training.distributed import check_launch, launched

    try:
        check_launch(
            args.nproc_per_node, args.nnodes, args.node_rank, args.rdzv_endpoint, args.rdzv_id, args.trusted_network
        )
    except ValueError as e:
        message = str(e)
        for name, option in OPTION_NAMES.items():
            message = message.replace(name, option)
        raise UserError(message) from None
    if (args.device or "").startswith("cuda:") and args.nproc_per_node > 1:
        raise UserError(
            f"--device {args.device} names one GPU, but --nproc-per-node {args.nproc_per_node} "
            "gives each process its own (cuda:LOCAL_RANK): use --device cuda"
        )
    return (args.nproc_per_node > 1 or args.nnodes > 1) and not launched()


def strip_launch_options(argv: list[str]) -> list[str]:
    """`argv` without the launcher's options (as `--opt V` or `--opt=V`): the ranks' command line."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in LAUNCH_OPTIONS:
            skip = True
        elif arg not in LAUNCH_FLAGS and not arg.startswith(tuple(o + "=" for o in LAUNCH_OPTIONS)):
            out.append(arg)
    return out


def relaunch(args: argparse.Namespace, argv: list[str]) -> int:
    """Run this command on `--nproc-per-node` ranks through torchrun; its exit status, or 130 if stopped."""
    from model.training import checkpoint as ckpt
    from model.training.distributed import endpoint_host, is_loopback, new_run_id, torchrun_command

    run_id = args.rdzv_id
    if args.nnodes > 1 and run_id is None:  # node 0 (check_launch refuses the others without one)
        run_id = new_run_id()
        print(f"rendezvous id: {run_id} (start the other nodes with --rdzv-id {run_id})", file=sys.stderr)
    if args.nnodes > 1 and not is_loopback(endpoint_host(args.rdzv_endpoint)):
        print(
            f"warning: --trusted-network: the rendezvous store on {args.rdzv_endpoint} runs code sent to its "
            "port; only the training nodes must be able to reach it",
            file=sys.stderr,
        )
    cmd = torchrun_command(
        ["-m", "app.cli", *strip_launch_options(argv)],
        args.nproc_per_node,
        args.nnodes,
        args.node_rank,
        args.rdzv_endpoint,
        run_id,
        args.trusted_network,
    )
    print(f"data parallel: {args.nproc_per_node} process(es) x {args.nnodes} node(s) through torchrun", file=sys.stderr)
    proc = subprocess.Popen(cmd)
    stopped = []

    def forward(signum, frame) -> None:  # the terminal's Ctrl-C reaches torchrun and the ranks already
        stopped.append(signum)
        if signum == signal.SIGTERM:
            proc.send_signal(signal.SIGTERM)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = proc.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if stopped:
        return 130
    if code != 0:
        latest = ckpt.latest_checkpoint(args.out)
        print(
            f"bert {args.command}: error: a training process failed (torchrun exit status {code}); the run "
            f"ended at {'checkpoint ' + str(latest) if latest else 'no checkpoint yet'}. Run the same command "
            "to resume.",
            file=sys.stderr,
        )
    return code
