"""The job-size estimate (model/sizing.py) against measured training runs.

Each case trains BertForPreTraining (MLM + NSP, 15% of positions masked, no padding: the worst case),
or a classifier with many labels (whose logits the estimate counts per row and label), for a few
AdamW steps with model.training.trainer.Trainer, in a fresh subprocess, and measures:
  * CPU: the peak resident memory (ru_maxrss) minus the resident memory just before the model was
    built (torch imported, the batches made): what training added;
  * CUDA: torch.cuda.max_memory_allocated() (the caching allocator's reserve and the context excluded).
It prints the estimate's parts, the measurement and measured / estimated: at or below 1.0 means the
estimate errs high (safe), as it should with PyTorch's fused attention.

    .venv/bin/python -m bench.sizing_bench                  # 5 CPU cases, ~3 minutes on 2 cores
    .venv/bin/python -m bench.sizing_bench --device cuda --precision bf16
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SMALL = dict(
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    intermediate_size=1024,
    vocab_size=8000,
    max_position_embeddings=512,
)
CASES = {  # name: (config, batch size, sequence length[, architecture, labels]); BertForPreTraining by default
    "small b32 s128": (SMALL, 32, 128),
    "medium b16 s256": (
        dict(
            hidden_size=512,
            num_hidden_layers=4,
            num_attention_heads=8,
            intermediate_size=2048,
            vocab_size=30522,
            max_position_embeddings=512,
        ),
        16,
        256,
    ),
    "base b8 s256": (
        dict(
            hidden_size=768,
            num_hidden_layers=12,
            num_attention_heads=12,
            intermediate_size=3072,
            vocab_size=30522,
            max_position_embeddings=512,
        ),
        8,
        256,
    ),
    "small tagger, 10k tags, b32 s128": (SMALL, 32, 128, "BertForTokenClassification", 10_000),
    "small classifier, 100k labels, b32 s128": (SMALL, 32, 128, "BertForSequenceClassification", 100_000),
}
STEPS = 3  # AdamW's moments appear at the first step; the second and third have everything alive


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def case(name: str) -> tuple[dict, int, int, str, int]:
    config, batch_size, seq_len, *head = CASES[name]
    architecture, labels = head or ("BertForPreTraining", 2)
    return config, batch_size, seq_len, architecture, labels


def batches(config: dict, batch_size: int, seq_len: int, count: int, architecture: str, num_labels: int):
    import torch

    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        ids = torch.randint(5, config["vocab_size"], (batch_size, seq_len), generator=g)
        if architecture != "BertForPreTraining":
            shape = (batch_size, seq_len) if architecture == "BertForTokenClassification" else (batch_size,)
            out.append(
                {
                    "input_ids": ids,
                    "attention_mask": torch.ones_like(ids),
                    "token_type_ids": torch.zeros_like(ids),
                    "labels": torch.randint(0, num_labels, shape, generator=g),
                }
            )
            continue
        labels = torch.full_like(ids, -100)
        masked = torch.rand(batch_size, seq_len, generator=g) < 0.15
        labels[masked] = ids[masked]
        out.append(
            {
                "input_ids": ids,
                "attention_mask": torch.ones_like(ids),
                "token_type_ids": torch.zeros_like(ids),
                "labels": labels,
                "next_sentence_label": torch.randint(0, 2, (batch_size,), generator=g),
            }
        )
    return out


class Fixed:
    """The trainer's BatchSource over a list of batches."""

    def __init__(self, items):
        self.items = items

    def num_batches(self, epoch):
        return len(self.items)

    def iter_batches(self, epoch, start_batch=0):
        return iter(self.items[start_batch:])


def measure(name: str, device: str, precision: str, threads: int) -> dict:
    """One case, in this process (run it in a fresh one): bytes that training added at its peak."""
    import torch

    from model.config import BertConfig
    from model.modeling import MODEL_CLASSES
    from model.training.trainer import TrainConfig, Trainer

    torch.set_num_threads(threads)
    config, batch_size, seq_len, architecture, labels = case(name)
    data = Fixed(batches(config, batch_size, seq_len, STEPS, architecture, labels))
    before = rss_bytes()
    torch.manual_seed(0)
    model = MODEL_CLASSES[architecture](BertConfig.from_dict({**config, "num_labels": labels}))
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    trainer = Trainer(model, data, TrainConfig(max_steps=STEPS, log_every=100, device=device, precision=precision))
    trainer.fit()
    if device == "cuda":
        return {"measured": torch.cuda.max_memory_allocated()}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {"measured": peak - before}


def estimate(name: str, precision: str) -> dict:
    from model.sizing import estimate_training

    config, batch_size, seq_len, architecture, labels = case(name)
    return estimate_training(
        config, architecture, batch_size=batch_size, seq_len=seq_len, precision=precision, num_labels=labels
    ).to_dict()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure this case and print JSON
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.device, args.precision, args.threads)))
        return
    rows = []
    print(f"device {args.device}, precision {args.precision}, {STEPS} AdamW steps, {args.threads} thread(s)")
    print(
        "| case | parameters | states (GB) | activations (GB) | overhead (GB) | estimate (GB) | measured (GB) | "
        "measured / estimate |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name in args.cases:
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "bench.sizing_bench",
                "--one",
                name,
                "--device",
                args.device,
                "--precision",
                args.precision,
                "--threads",
                str(args.threads),
            ],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).resolve().parents[1],
        )
        measured = json.loads(run.stdout.strip().splitlines()[-1])["measured"]
        est = estimate(name, args.precision)
        gb = 1024**3
        states = est["weights_bytes"] + est["gradient_bytes"] + est["optimizer_bytes"]
        row = {"case": name, **est, "measured_bytes": measured, "ratio": measured / est["memory_bytes"]}
        rows.append(row)
        print(
            f"| {name} | {est['parameters'] / 1e6:.1f} M | {states / gb:.2f} | {est['activation_bytes'] / gb:.2f} | "
            f"{est['overhead_bytes'] / gb:.2f} | "
            f"{est['memory_bytes'] / gb:.2f} | {measured / gb:.2f} | {row['ratio']:.2f} |",
            flush=True,
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
