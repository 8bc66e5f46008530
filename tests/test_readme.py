"""The documentation's examples (README.md and every page of docs/), run against the system started the
way `make run` starts it.

`bert up` runs as a subprocess (API + a real `celery worker` over the sqlite broker, MiniLM imported,
the bootstrap job shortened to a few steps). Every ```console block runs, command by command, in one
bash process, in a scratch folder that holds the system's `data/` and links to the repository's
`examples/` and `.venv` (so `.venv/bin/bert` and `data/models/minilm` mean what they mean after
`make run`), with the port swapped for the test's. That folder stands for the repository's root, where a
reader runs the examples: what a page's examples leave there must be what git ignores (`runs/`, `data/`).
The Hugging Face Hub is tests/hub_server.py's, serving tiny models under the repo ids the pages import
(with their heads, labels and casing). Each command must succeed and print what the page shows: the
same JSON shape (keys, lengths, types) and the same values for the keys that do not vary from run to
run; text output line by line, numbers aside, a `...` line standing for any lines.

The pages run in the order of README.md, then mkdocs.yml's nav, each page's blocks top to bottom, as a
reader following them would. A block that cannot run here carries a skip marker on the line above it,
`<!-- docs-test: skip REASON -->`; REASON is one of SKIP_REASONS, and tests/test_docs.py checks that it
is used only on the blocks it names. Any other block holding a `$ ` prompt must be a ```console block.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.helpers import free_port
from tests.hub_server import docs_hub

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
BERT = VENV_BIN / "bert"
# Values compared exactly; everything else is compared by type (scores and ids differ run to run).
STABLE_KEYS = {
    "status",
    "error_type",
    "object",
    "kind",
    "architecture",
    "name",
    "model_name",
    "base_model",
    "dataset",
    "default",
    "heads",
    "format",
    "labels",
    "index",
    "bytes",  # a file's size
}
# Present, but their value, length or null-ness depends on timing (a job record read mid-run).
LOOSE_KEYS = {
    "events",
    "worker",
    "started_at",
    "finished_at",
    "heartbeat_at",
    "eval",
    "result",
    "latest_checkpoint",
    "loss",
    "lr",
    "tokens_per_s",
    "eta_s",
    "epoch",
    "loaded",
    "queue_position",
    "waiting_for",
    "start_estimate_s",
    "phase",  # what a job does before its first step report: null when it is queued or already stepping
    "runtime_s",
}
MORE = "__more__"
HUB_ENV: dict[str, str] = {}  # huggingface_hub's settings for every command: the docs' fake Hub
SKIP = re.compile(r"<!-- docs-test: skip ([\w-]+) -->\n *$")
# The blocks that cannot run in a test, and what every command of such a block must be.
SKIP_REASONS = {
    "make": re.compile(r"^make \w"),  # `make run` / `make test`: the system this test starts, the suite it is in
    "docker": re.compile(r"^docker "),  # needs a Docker engine (tests/test_compose.py runs the compose stack)
    "gpu": re.compile(r"cuda|gpu"),  # needs a CUDA device
    "multi-node": re.compile(r"--nnodes [2-9]"),  # torchrun across machines
    "kubernetes": re.compile(r"^kubectl |deploy/kubernetes/"),  # a cluster, or the repository's manifests
}


def pages() -> list[Path]:
    """README.md, then the site's pages in nav order."""
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    return [ROOT / "README.md"] + [ROOT / "docs" / next(iter(entry.values())) for entry in nav]


# ---------------------------------------------------------------------------- page parsing


def fenced_blocks(text: str) -> list[tuple[str, str, str | None]]:
    """(language, body, skip reason or None) for every fenced block of a page, one in a list item too."""
    blocks = []
    for m in re.finditer(r"^( *)```(\w*)[^\n]*\n(.*?)^\1```", text, re.S | re.M):
        skip = SKIP.search(text[: m.start()][-200:])
        body = re.sub(rf"^{m.group(1)}", "", m.group(3), flags=re.M)
        blocks.append((m.group(2), body, skip.group(1) if skip else None))
    return blocks


def commands(body: str) -> list[tuple[str, str]]:
    """[(command, documented output)] of a console block: `$ ` lines, their `\\` continuations, then output."""
    pairs, current = [], None
    for line in body.splitlines():
        if line.startswith("$ "):
            current = [line[2:], []]
            pairs.append(current)
        elif current is not None and current[0].endswith("\\") and not current[1]:
            current[0] += "\n" + line
        elif current is not None:
            current[1].append(line)
    return [(cmd, "\n".join(out).strip()) for cmd, out in pairs]


def console_blocks(text: str) -> list[list[tuple[str, str]]]:
    """The commands of every ```console block that runs (no skip marker)."""
    return [commands(body) for lang, body, skip in fenced_blocks(text) if lang == "console" and skip is None]


def strip_comment(command: str) -> str:
    return re.sub(r"\s+# [^'\"]*$", "", command)


def parse_documented(text: str):
    """A page's JSON, where `...` stands for "more elements/keys"; None if it is not JSON."""
    text = re.sub(r",\s*\.\.\.\s*\]", f', "{MORE}"]', text)
    text = re.sub(r",\s*\.\.\.\s*\}", f', "{MORE}": null}}', text)
    try:
        return json.loads(text)
    except ValueError:
        return None


def same_shape(doc, got, key: str = "", path: str = "$") -> None:
    if key in LOOSE_KEYS:
        return
    if isinstance(doc, dict):
        assert isinstance(got, dict), f"{path}: expected an object, got {got!r:.80}"
        more = MORE in doc
        keys = set(doc) - {MORE}
        assert keys <= set(got) if more else keys == set(got), f"{path}: keys {sorted(got)} != {sorted(keys)}"
        for k in keys:
            same_shape(doc[k], got[k], k, f"{path}.{k}")
    elif isinstance(doc, list):
        assert isinstance(got, list), f"{path}: expected a list, got {got!r:.80}"
        more = bool(doc) and doc[-1] == MORE
        items = doc[:-1] if more else doc
        assert len(got) >= len(items) if more else len(got) == len(items), f"{path}: {len(got)} items"
        for i, d in enumerate(items):
            same_shape(d, got[i], key, f"{path}[{i}]")
    elif isinstance(doc, bool) or doc is None or isinstance(doc, str):
        if key in STABLE_KEYS or doc is None:
            assert got == doc, f"{path}: {got!r} != {doc!r}"
        else:
            assert type(got) is type(doc), f"{path}: {got!r:.80} is not a {type(doc).__name__}"
    else:  # numbers: ints stay ints; floats may print as ints (0 vs 0.0)
        assert isinstance(got, (int, float)) and not isinstance(got, bool), f"{path}: {got!r} is not a number"
        if key in STABLE_KEYS:
            assert got == doc, f"{path}: {got!r} != {doc!r}"


def same_text_shape(doc: str, got: str) -> None:
    """Non-JSON output: the same lines with every number allowed to differ; a `...` line is any lines."""

    def shape(s: str) -> list[str]:
        return [re.sub(r"[-+]?\d[\d,]*(\.\d+)?(e[-+]?\d+)?", "#", line.rstrip()) for line in s.strip().splitlines()]

    assert lines_match(shape(doc), shape(got)), f"{shape(got)} does not match {shape(doc)}"


def lines_match(doc: list[str], got: list[str]) -> bool:
    if not doc:
        return not got
    if doc[0].strip() == "...":
        return any(lines_match(doc[1:], got[i:]) for i in range(len(got) + 1))
    return bool(got) and doc[0] == got[0] and lines_match(doc[1:], got[1:])


# ---------------------------------------------------------------------------- the system


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    """(port, scratch folder) of a running `bert up`; the scratch folder holds its data/."""
    scratch = tmp_path_factory.mktemp("docs")
    data_dir = scratch / "data"
    (scratch / "examples").symlink_to(ROOT / "examples")
    (scratch / ".venv").symlink_to(VENV_BIN.parent)
    port = free_port()
    hub = docs_hub(tmp_path_factory.mktemp("hub"))  # the Hub models the pages import, as tiny stand-ins
    HUB_ENV.update(HF_ENDPOINT=hub.url, HF_HOME=str(scratch / "hf"), HF_HUB_DISABLE_PROGRESS_BARS="1")
    env = {k: v for k, v in os.environ.items() if not k.startswith("BERT_") and k != "REDIS_URL"}
    env.update(HUB_ENV)
    env.pop("HF_HUB_OFFLINE", None)
    env["BERT_MLM_MODEL"] = ""  # the first start trains wiki-mlm, which the pages show
    log = open(scratch / "bert-up.log", "w")  # noqa: SIM115  (bert up's output for the whole module)
    proc = subprocess.Popen(
        [str(BERT), "up", "--data-dir", str(data_dir), "--port", str(port), "--bootstrap-steps", "3"],
        cwd=scratch,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait(lambda: httpx.get(f"{url}/ready").status_code == 200, 240, "/ready", proc, log)
        wait(lambda: bootstrap_state(url) in ("succeeded", "failed"), 420, "the bootstrap job", proc, log)
        assert bootstrap_state(url) == "succeeded", (scratch / "bert-up.log").read_text()[-3000:]
        yield port, scratch
    finally:
        proc.send_signal(signal.SIGTERM)  # as Ctrl-C would: the worker hands its job back
        try:
            proc.wait(150)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
        hub.stop()


def bootstrap_state(url: str) -> str | None:
    jobs = httpx.get(f"{url}/jobs").json()["jobs"]
    return next((j["state"] for j in jobs if j["model_name"] == "wiki-mlm"), None)


def wait(predicate, timeout: float, what: str, proc, log) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"bert up exited with {proc.returncode}: see {log.name}"
        try:
            if predicate():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}; see {log.name}")


def run_block(pairs: list[tuple[str, str]], port: int, cwd: Path) -> list[tuple[str, int, str]]:
    """Run a block's commands in one bash process; [(command, exit status, output)]."""
    script = ["set -o pipefail"]
    for i, (command, _) in enumerate(pairs):
        command = strip_comment(command.replace("localhost:8000", f"localhost:{port}"))
        script += [f"echo '@@@START {i}'", command, f'echo; echo "@@@END {i} $?"']
    env = {k: v for k, v in os.environ.items() if not k.startswith("BERT_") and k != "REDIS_URL"}
    env.update(PATH=f"{VENV_BIN}:{env['PATH']}", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **HUB_ENV)
    env.pop("HF_HUB_OFFLINE", None)
    proc = subprocess.run(
        ["bash", "-c", "\n".join(script)], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )
    results = []
    for i, (command, _) in enumerate(pairs):
        m = re.search(rf"@@@START {i}\n(.*?)\n@@@END {i} (\d+)", proc.stdout, re.S)
        assert m, f"no output for {command!r}: {proc.stdout[-2000:]} {proc.stderr[-2000:]}"
        results.append((command, int(m.group(2)), m.group(1).strip()))
    return results


def check_output(command: str, documented: str, got: str) -> None:
    doc = parse_documented(documented)
    try:
        if doc is None:
            same_text_shape(documented, got)
        else:
            same_shape(doc, json.loads(got))
    except (AssertionError, ValueError) as e:
        raise AssertionError(f"{command}\nthe page shows:\n{documented}\ngot:\n{got[:3000]}\n{e}") from None


# The scratch folder's own entries: links into the repository, the Hub's cache (HF_HOME), bert up's log.
SCRATCH_OWN = {"examples", ".venv", "hf", "bert-up.log"}


def not_ignored(scratch: Path) -> list[str]:
    """The entries of the scratch folder, beside its own, that git would list as untracked in the repository."""
    names = [
        p.name + ("/" if p.is_dir() and not p.is_symlink() else "")
        for p in scratch.iterdir()
        if p.name not in SCRATCH_OWN
    ]
    proc = subprocess.run(
        ["git", "check-ignore", "--no-index", "--stdin"],
        cwd=ROOT,
        input="\n".join(names),
        capture_output=True,
        text=True,
    )
    assert proc.returncode in (0, 1), proc.stderr  # 1: none ignored
    return sorted(set(names) - set(proc.stdout.splitlines()))


def examples_status() -> str:
    """`git status` of examples/, which the scratch folder links to: the pages read it and never write there."""
    return subprocess.run(
        ["git", "status", "--porcelain", "--", "examples"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("page", pages(), ids=lambda p: p.name)
def test_examples_run_and_print_what_the_page_shows(system, page):
    port, scratch = system
    blocks = console_blocks(page.read_text())
    examples_before = examples_status()
    for pairs in blocks:
        for (command, status, got), (_, documented) in zip(run_block(pairs, port, scratch), pairs):
            assert status == 0, f"{page.name}: {command}\nexit {status}: {got[:2000]}"
            if documented:
                check_output(command, documented, got)
    left = not_ignored(scratch)
    assert not left, (
        f"{page.name}: its examples leave {left} in the folder a reader runs them in (the repository's root), "
        "which git does not ignore: write under runs/ or a temporary directory"
    )
    assert examples_status() == examples_before, f"{page.name}: its examples changed examples/"


def test_the_leftover_check_sees_what_git_would_show(tmp_path):
    for name in ("runs", "data", "hf"):
        (tmp_path / name).mkdir()
    (tmp_path / "corpus.txt").write_text("a corpus")
    assert not_ignored(tmp_path) == ["corpus.txt"]


def test_the_readme_tours_every_route_family():
    """README's tour: one curl at least for each family of routes."""
    curls = " ".join(cmd for pairs in console_blocks((ROOT / "README.md").read_text()) for cmd, _ in pairs)
    for route in (
        "/fill-mask",
        "/nsp",
        "/embeddings",
        "/v1/embeddings",
        "/classify",
        "/token-classification",
        "/question-answering",
        "/embed",
        "/jobs",
        "/datasets",
        "/models",
        "/health",
        "/metrics",
    ):
        assert f"localhost:8000{route}" in curls, route
