"""Held-out learning runs: fine-tune MiniLM for NER and for extractive QA on synthetic sets whose test
entities and answers training never sees (bench/synthetic.py), and score the held-out split.

Each run goes through the `bert` CLI in a subprocess, as a user runs it:
    bert finetune --task token-classification|question-answering --train T --eval DEV --from MINILM --out RUN
    bert evaluate --model RUN --data TEST --json
DEV is drawn from the train split's pools with another seed (model selection never sees the test
split); TEST is the held-out split. MiniLM (all-MiniLM-L6-v2) is a sentence encoder without task
heads: the token-classification and QA heads start from fresh weights. The table gives the sizes,
steps, wall time of fine-tuning and of evaluation, the held-out metrics and pass/fail against F1 >= 0.9.

    .venv/bin/python -m bench.learning_runs                   # both tasks, a few minutes each on 2 cores
    .venv/bin/python -m bench.learning_runs --tasks ner --ner-steps 300 --out /tmp/learn
    .venv/bin/python -m bench.learning_runs --quick           # smoke run: tiny sets, a few steps, no verdict
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

from app.launcher.demo_data import ensure_minilm  # noqa: E402
from bench.common import machine_line, markdown_table, setup  # noqa: E402
from bench.synthetic import conll_text, ner_split, qa_split, write_ner, write_qa  # noqa: E402
from datadir.files import atomic_write_bytes  # noqa: E402

TARGET_F1 = 0.9
DEV_SEED_OFFSET = 1000  # dev sets: the train split's pools, another seed


@dataclass
class Run:
    """One task's run: what it trained on, how long it took, what it scored."""

    task: str
    cli_task: str
    train: str
    dev: str
    test: str
    sizes: str
    options: dict
    finetune_s: float = 0.0
    evaluate_s: float = 0.0
    metrics: dict = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.metrics.get("f1", 0.0) >= TARGET_F1


def make_data(out: Path, args: argparse.Namespace) -> dict[str, Run]:
    """The synthetic sets in out/data, one Run per task asked for."""
    data, runs = out / "data", {}
    if "ner" in args.tasks:
        ner = write_ner(data, args.seed, args.ner_train, args.ner_test)
        dev = data / "ner-dev.conll"
        atomic_write_bytes(dev, conll_text(ner_split("train", args.ner_dev, args.seed + DEV_SEED_OFFSET)).encode())
        runs["ner"] = Run(
            "ner",
            "token-classification",
            ner["train"],
            str(dev),
            ner["test"],
            f"{args.ner_train} / {args.ner_test} sentences",
            {
                "--max-steps": args.ner_steps,
                "--batch-size": args.batch_size,
                "--max-seq-len": args.ner_max_seq_len,
                "--lr": args.ner_lr,
            },
        )
    if "qa" in args.tasks:
        qa = write_qa(data, args.seed, args.qa_train, args.qa_test)
        dev = data / "qa-dev.json"
        atomic_write_bytes(dev, json.dumps(qa_split("train", args.qa_dev, args.seed + DEV_SEED_OFFSET)).encode())
        runs["qa"] = Run(
            "qa",
            "question-answering",
            qa["train"],
            str(dev),
            qa["test"],
            f"{qa['train_questions']} / {qa['test_questions']} questions",
            {
                "--max-steps": args.qa_steps,
                "--batch-size": args.batch_size,
                "--max-seq-len": args.qa_max_seq_len,
                "--lr": args.qa_lr,
                "--doc-stride": args.doc_stride,
            },
        )
    return runs


def bert(args: list[str], threads: int, log: Path) -> tuple[float, str]:
    """Run `python -m app.cli ARGS`; (wall seconds, stdout). Its stderr goes to `log`; a failure exits."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads)}
    start = time.perf_counter()
    with open(log, "w") as err:
        proc = subprocess.run(
            [sys.executable, "-m", "app.cli", *args], cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=err
        )
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(
            f"bert {args[0]} failed with exit code {proc.returncode}; see {log}:\n"
            + log.read_text()[-3000:]
            + proc.stdout[-2000:]
        )
    return wall, proc.stdout


def run_task(run: Run, minilm: Path, out: Path, args: argparse.Namespace) -> Run:
    run_dir = out / f"run-{run.task}"
    options = [str(x) for key, value in run.options.items() for x in (key, value)]
    run.finetune_s, _ = bert(
        [
            "finetune",
            "--task",
            run.cli_task,
            "--train",
            run.train,
            "--eval",
            run.dev,
            "--from",
            str(minilm),
            "--out",
            str(run_dir),
            "--no-resume",
            "--seed",
            str(args.seed),
            "--threads",
            str(args.threads),
            *options,
        ],
        args.threads,
        out / f"finetune-{run.task}.log",
    )
    run.evaluate_s, stdout = bert(
        [
            "evaluate",
            "--model",
            str(run_dir),
            "--data",
            run.test,
            "--json",
            "--threads",
            str(args.threads),
            "--max-seq-len",
            str(run.options["--max-seq-len"]),
        ],
        args.threads,
        out / f"evaluate-{run.task}.log",
    )
    run.metrics = json.loads(stdout[stdout.index("{") :])
    return run


def metrics_text(metrics: dict) -> str:
    keys = [k for k in ("precision", "recall", "f1", "accuracy", "exact_match") if k in metrics]
    return ", ".join(f"{k} {metrics[k]:.3f}" for k in keys)


def report(runs: list[Run], quick: bool) -> str:
    rows = [
        [
            r.task,
            r.sizes,
            r.options["--max-steps"],
            r.options["--batch-size"],
            r.options["--max-seq-len"],
            r.options["--lr"],
            f"{r.finetune_s:.0f} s",
            f"{r.evaluate_s:.0f} s",
            metrics_text(r.metrics),
            "(quick)" if quick else ("pass" if r.passed else "FAIL"),
        ]
        for r in runs
    ]
    return markdown_table(
        [
            "task",
            "train / test",
            "steps",
            "batch",
            "seq",
            "lr",
            "fine-tune",
            "evaluate",
            "held-out",
            f"F1 >= {TARGET_F1}",
        ],
        rows,
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tasks", default="ner,qa", help="comma-separated: ner, qa (default both)")
    p.add_argument("--out", help="output directory: data, runs, logs, results.json (default: a temp dir)")
    p.add_argument(
        "--threads",
        type=int,
        default=2,
        help="torch threads of every bert command (default 2; on a busy machine 1 can be several times faster)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--ner-train", type=int, default=2000, help="train sentences")
    p.add_argument("--ner-dev", type=int, default=200)
    p.add_argument("--ner-test", type=int, default=400)
    p.add_argument("--ner-steps", type=int, default=200)
    p.add_argument("--ner-max-seq-len", type=int, default=48, help="the longest sentence is 31 pieces")
    p.add_argument("--ner-lr", type=float, default=1e-4)
    p.add_argument("--qa-train", type=int, default=800, help="train contexts (about 4.9 questions each)")
    p.add_argument("--qa-dev", type=int, default=40)
    p.add_argument("--qa-test", type=int, default=150)
    p.add_argument("--qa-steps", type=int, default=450)
    p.add_argument("--qa-max-seq-len", type=int, default=128, help="the longest question + context is 112 pieces")
    p.add_argument("--qa-lr", type=float, default=1e-4)
    p.add_argument("--doc-stride", type=int, default=32)
    p.add_argument("--quick", action="store_true", help="smoke run: tiny sets, 6 steps, no pass/fail")
    args = p.parse_args(argv)
    args.tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    unknown = sorted(set(args.tasks) - {"ner", "qa"})
    if unknown or not args.tasks:
        p.error(f"--tasks takes ner and/or qa, got {unknown or args.tasks}")
    if args.quick:
        args.ner_train, args.ner_dev, args.ner_test, args.ner_steps = 64, 16, 32, 6
        args.qa_train, args.qa_dev, args.qa_test, args.qa_steps = 16, 4, 8, 6
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup(args.threads)
    with tempfile.TemporaryDirectory(prefix="learning-runs-") as tmp:
        out = Path(args.out or tmp)
        out.mkdir(parents=True, exist_ok=True)
        runs = make_data(out, args)
        minilm = ensure_minilm(out / "minilm")
        where = out if args.out else f"{out} (removed at exit; keep them with --out)"
        print(f"# Held-out learning runs from MiniLM\n\n{machine_line()}; data, runs and logs in {where}\n", flush=True)
        done = [run_task(run, minilm, out, args) for run in runs.values()]
        print(report(done, args.quick))
        results = [
            {
                "task": r.task,
                "sizes": r.sizes,
                "options": r.options,
                "finetune_s": round(r.finetune_s, 1),
                "evaluate_s": round(r.evaluate_s, 1),
                "metrics": r.metrics,
                "passed": r.passed,
            }
            for r in done
        ]
        atomic_write_bytes(out / "results.json", json.dumps(results, indent=2).encode())
    return 0 if args.quick or all(r.passed for r in done) else 1


if __name__ == "__main__":
    sys.exit(main())
