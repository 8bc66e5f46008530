"""`bert corpus build` throughput against the tokenizers library's own ceiling on the same text.

Generates --size-mb of mixed inputs in --dir (kept between runs; not in the repo): the Wikipedia leads
and Rotten Tomatoes snippets of the demo assets, copied over and over with varied edits (a word
swapped, a number added, sentences reordered; about 1 paragraph in 10 left exact, for the dedup to
find), across many .txt, .txt.gz and .jsonl files, plus a synthetic Wikipedia dump (.xml.bz2) whose
articles carry templates, references, tables, links and categories. Then, in turns (--repeat):

  ceiling  one process, RAYON_NUM_THREADS=--workers: every sentence of the same files (read with the
           same readers) through `Tokenizer.encode_batch_fast` in ~1 MB batches; only the encode calls
           are timed, so reading, splitting and writing cost it nothing;
  build    `bert corpus build DIR --workers N` in a subprocess, timed wall clock end to end (start-up,
           reading, cleaning, dedup, shards, sha256, manifest), peak RSS summed over its process tree
           (sampled every 0.2 s from /proc).

tokens/s for both is the ceiling's token count of the whole input over the side's time, so the ratio
is the ceiling's encode time over the build's wall time. CPU seconds of both sides are reported as well:
on a machine others share, their ratio moves far less than wall-clock time. The build tokenises less than the ceiling
(a paragraph repeated within a work unit is dropped before tokenising), so the stricter ratio, the
tokens the store keeps over the build's time, is printed too. Medians over --repeat turns.

    .venv/bin/python -m bench.corpus_bench --size-mb 1024 --workers 2
"""

from __future__ import annotations

import argparse
import bz2
import contextlib
import csv
import gzip
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROOT = Path(__file__).resolve().parents[1]
FILE_MB = 24  # size of each generated file
EDIT_WORDS = "notably also later early modern small large first second famous local".split()


# ---------------------------------------------------------------------------- inputs


def base_paragraphs() -> tuple[list[str], list[tuple[str, str]]]:
    """The demo assets' paragraphs (wiki leads and reviews), and (title, lead) pairs for the dump."""
    from bench.common import ROTTEN_TOMATOES, WIKI_JSON

    wiki = [
        (page.get("title") or title, page.get("extract") or "")
        for title, page in json.loads(WIKI_JSON.read_text()).items()
    ]
    wiki = [(t, e.strip()) for t, e in wiki if e.strip()]
    with bz2.open(ROTTEN_TOMATOES, "rt", encoding="utf-8", newline="") as f:
        reviews = [row["text"].strip() for row in csv.DictReader(f) if row["text"].strip()]
    paragraphs = [p.strip() for _, e in wiki for p in e.split("\n") if p.strip()] + reviews
    return paragraphs, wiki


def edited(paragraph: str, rng: random.Random) -> str:
    """A variant of the paragraph; 1 in 10 stays exact (a duplicate for the build to drop)."""
    kind = rng.randrange(10)
    if kind == 0:
        return paragraph
    words = paragraph.split(" ")
    if kind < 5:
        words[rng.randrange(len(words))] = rng.choice(EDIT_WORDS)
    elif kind < 8:
        words.insert(rng.randrange(len(words) + 1), str(rng.randrange(1000, 2100)))
    else:
        cut = rng.randrange(len(words) + 1)
        words = words[cut:] + words[:cut]
    return " ".join(words)


def wiki_markup(title: str, lead: str, rng: random.Random) -> str:
    words = lead.split(" ")
    for _ in range(min(3, len(words))):
        i = rng.randrange(len(words))
        words[i] = f"[[{words[i]}]]" if rng.random() < 0.5 else f"[[Target {i}|{words[i]}]]"
    body = " ".join(words)
    return (
        f"{{{{Infobox thing\n| name = {title}\n| size = {rng.randrange(99)}\n}}}}\n'''{title}''' "
        f'{body}<ref name="r{rng.randrange(9)}">{{{{cite web|url=http://example.org|title=x}}}}</ref>\n\n'
        f"== History ==\n{body} {{{{convert|3|km}}}}<ref>A book, p. 4.</ref>\n"
        '{| class="wikitable"\n|-\n! Year !! Value\n|-\n| 1990 || 12\n|}\n'
        f"[[File:{title}.jpg|thumb|A picture]]\n[[Category:Things]]\n"
    )


def write_dump(path: Path, wiki: list[tuple[str, str]], rng: random.Random) -> None:
    from xml.sax.saxutils import escape

    with bz2.open(path, "wt", encoding="utf-8") as f:
        f.write('<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/" version="0.10">\n')
        for i, (title, lead) in enumerate(wiki):
            f.write(
                f"<page><title>{escape(title)}</title><ns>0</ns><id>{i}</id><revision><text>"
                f"{escape(wiki_markup(title, lead, rng))}</text></revision></page>\n"
            )
            if i % 50 == 0:  # a redirect and a talk page now and then, for the reader to skip
                f.write(
                    f'<page><title>R{i}</title><ns>0</ns><redirect title="{escape(title)}"/><revision>'
                    f"<text>#REDIRECT [[{escape(title)}]]</text></revision></page>\n"
                    f"<page><title>Talk:{escape(title)}</title><ns>1</ns><revision><text>Talk."
                    "</text></revision></page>\n"
                )
        f.write("</mediawiki>\n")


def generate(directory: Path, size_mb: int, seed: int = 0) -> None:
    marker = directory / ".generated.json"
    spec = {"size_mb": size_mb, "seed": seed, "version": 1}
    if marker.is_file() and json.loads(marker.read_text()) == spec:
        return
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    rng = random.Random(seed)
    paragraphs, wiki = base_paragraphs()
    write_dump(directory / "enwiki-synthetic-pages-articles.xml.bz2", wiki[:3000], rng)
    written, index = 0, 0
    while written < size_mb * 2**20:
        kind = ("txt", "txt.gz", "jsonl")[index % 3]
        written += write_file(directory / f"part-{index:04d}.{kind}", kind, paragraphs, rng)
        index += 1
    marker.write_text(json.dumps(spec))


def write_file(path: Path, kind: str, paragraphs: list[str], rng: random.Random) -> int:
    """One ~FILE_MB file of edited paragraphs; returns its text's size in bytes."""
    chunks, size = [], 0
    while size < FILE_MB * 2**20:
        p = edited(paragraphs[rng.randrange(len(paragraphs))], rng)
        if kind == "jsonl":
            p = json.dumps({"text": p, "id": size}) + "\n"
        else:
            p += "\n\n"
        chunks.append(p)
        size += len(p)
    text = "".join(chunks)
    if kind == "txt.gz":
        with gzip.open(path, "wt", encoding="utf-8", compresslevel=1) as f:
            f.write(text)
    else:
        path.write_text(text, encoding="utf-8")
    return len(text.encode("utf-8"))


# ---------------------------------------------------------------------------- the two sides


def ceiling(directory: Path) -> dict:
    """Run in a fresh process (RAYON_NUM_THREADS set by the caller): encode every sentence, time only that."""
    from bench.common import MINILM_DIR
    from model.data.corpus import read_paragraphs
    from model.data.corpus_build import ENCODE_CHARS, expand_inputs
    from model.tokenizer import BertTokenizer

    tok = BertTokenizer.from_pretrained(MINILM_DIR).backend_tokenizer
    tokens = sentences = 0
    encode_s = encode_cpu_s = 0.0
    batch, size = [], 0

    def flush():
        nonlocal tokens, sentences, encode_s, encode_cpu_s, batch, size
        t, cpu = time.perf_counter(), time.process_time()  # process time: all Rust threads
        encodings = tok.encode_batch_fast(batch, add_special_tokens=False)
        encode_s += time.perf_counter() - t
        encode_cpu_s += time.process_time() - cpu
        tokens += sum(len(e.ids) for e in encodings)
        sentences += len(batch)
        batch, size = [], 0

    for path in expand_inputs([directory]):
        for doc in read_paragraphs(path, errors="replace"):
            for paragraph in doc:
                batch += paragraph
                size += sum(map(len, paragraph))
            if size >= ENCODE_CHARS:
                flush()
    if batch:
        flush()
    return {"tokens": tokens, "sentences": sentences, "encode_s": encode_s, "encode_cpu_s": encode_cpu_s}


def tree_rss(root: int) -> int:
    """Resident bytes of a process and all its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        with contextlib.suppress(OSError):
            total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return total


def run_sampled(cmd: list[str], env: dict) -> tuple[float, int, str, float]:
    """Wall seconds, peak tree RSS, stdout and CPU seconds (the whole process tree) of a command."""
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    peak, started = 0, time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, env=env, text=True, cwd=ROOT)
    out = []
    reader = threading.Thread(target=lambda: out.append(proc.stdout.read()))
    reader.start()
    while proc.poll() is None:
        peak = max(peak, tree_rss(proc.pid))
        time.sleep(0.2)
    reader.join()
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"{cmd} failed with status {proc.returncode}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return seconds, peak, "".join(out), cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=int, default=100, help="generated input size (default 100)")
    ap.add_argument("--dir", default="/tmp/corpus_bench", help="where inputs and the store go")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--ceiling-only", help=argparse.SUPPRESS)  # internal: the ceiling's own process
    args = ap.parse_args()
    if args.ceiling_only:
        print(json.dumps(ceiling(Path(args.ceiling_only))))
        return
    from bench.common import MINILM_DIR, machine_line

    inputs, store = Path(args.dir) / "inputs", Path(args.dir) / "store"
    t = time.perf_counter()
    generate(inputs, args.size_mb)
    size = sum(p.stat().st_size for p in inputs.iterdir() if not p.name.startswith("."))
    print(
        f"inputs: {len(list(inputs.iterdir())) - 1} files, {size / 2**20:,.0f} MiB on disk in {inputs} "
        f"(ready in {time.perf_counter() - t:.0f} s)",
        flush=True,
    )
    env = {**os.environ, "RAYON_NUM_THREADS": str(args.workers), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    turns = []
    for _ in range(args.repeat):
        c_wall, c_rss, c_out, _ = run_sampled(
            [sys.executable, "-m", "bench.corpus_bench", "--ceiling-only", str(inputs)], env
        )
        c = json.loads(c_out)
        shutil.rmtree(store, ignore_errors=True)
        b_wall, b_rss, summary, b_cpu = run_sampled(
            [
                sys.executable,
                "-m",
                "app.cli",
                "corpus",
                "build",
                str(inputs),
                "--tokenizer",
                str(MINILM_DIR),
                "--out",
                str(store),
                "--workers",
                str(args.workers),
            ],
            env,
        )
        manifest = json.loads((store / "manifest.json").read_text())
        turns.append(
            {
                "tokens": c["tokens"],
                "ceiling_s": c["encode_s"],
                "ceiling_cpu_s": c["encode_cpu_s"],
                "ceiling_rss": c_rss,
                "build_s": b_wall,
                "build_cpu_s": b_cpu,
                "build_rss": b_rss,
                "stored_tokens": manifest["totals"]["tokens"],
                "shards": len(manifest["shards"]),
                "stats": manifest["stats"],
            }
        )
        print(summary.strip() + "\n" + json.dumps(turns[-1]), flush=True)
    med = {
        k: statistics.median(t[k] for t in turns)
        for k in (
            "tokens",
            "ceiling_s",
            "build_s",
            "build_rss",
            "ceiling_rss",
            "stored_tokens",
            "ceiling_cpu_s",
            "build_cpu_s",
        )
    }
    ceiling_rate, build_rate = med["tokens"] / med["ceiling_s"], med["tokens"] / med["build_s"]
    print(f"\n{machine_line()}; {args.workers} workers / {args.workers} Rust threads; medians of {args.repeat}")
    print("| side | time | tokens/s | MiB/s (on disk) | peak RSS |\n|---|---|---|---|---|")
    print(
        f"| encode_batch_fast ceiling (encode calls only) | {med['ceiling_s']:.1f} s | {ceiling_rate:,.0f} | "
        f"{size / 2**20 / med['ceiling_s']:.2f} | {med['ceiling_rss'] / 2**20:,.0f} MiB |"
    )
    print(
        f"| bert corpus build --workers {args.workers} (wall) | {med['build_s']:.1f} s | {build_rate:,.0f} | "
        f"{size / 2**20 / med['build_s']:.2f} | {med['build_rss'] / 2**20:,.0f} MiB |"
    )
    stored_rate = med["stored_tokens"] / med["build_s"]
    print(
        f"\nbuild / ceiling: {build_rate / ceiling_rate:.1%} counting input tokens; "
        f"{stored_rate / ceiling_rate:.1%} counting only the {med['stored_tokens']:,.0f} tokens stored after "
        f"dedup and cleaning (of {med['tokens']:,.0f}); {turns[-1]['shards']} shards"
    )
    ratios = [t["ceiling_s"] / t["build_s"] for t in turns]
    print(
        f"per turn (ceiling time / build time): {', '.join(f'{r:.0%}' for r in ratios)}; CPU seconds: "
        f"ceiling {med['ceiling_cpu_s']:.1f} (encode calls), build {med['build_cpu_s']:.1f} (whole process "
        f"tree), ratio {med['ceiling_cpu_s'] / med['build_cpu_s']:.1%}: what the build would reach on idle cores "
        "it keeps busy"
    )


if __name__ == "__main__":
    main()
