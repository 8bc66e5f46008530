"""The README's examples, run against the system started the way `make run` starts it.

`bert up` runs as a subprocess (API + a real `celery worker` over the sqlite broker, MiniLM imported,
the bootstrap job shortened to a few steps). Every ```console block of the README that holds a curl
runs in one bash process, in the repository root, with the port swapped for the test's; each
command must succeed and print what the README shows: the same JSON shape (keys, lengths, types),
and the same values for the keys that do not vary from run to run.
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

from tests.helpers import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
BERT = Path(sys.executable).parent / "bert"
# Values compared exactly; everything else is compared by type (scores and ids differ run to run).
STABLE_KEYS = {"status", "error_type", "object", "kind", "architecture", "name", "model_name", "base_model",
               "dataset", "default", "heads", "format", "labels", "index"}
# Present, but their value, length or null-ness depends on timing (a job record read mid-run).
LOOSE_KEYS = {"events", "worker", "started_at", "finished_at", "heartbeat_at", "eval", "result",
              "latest_checkpoint", "loss", "lr", "tokens_per_s", "eta_s", "epoch", "loaded"}
MORE = "__more__"
RUNNABLE = ("curl", "ID=", "until")


# ---------------------------------------------------------------------------- README parsing

def console_blocks(text: str) -> list[list[tuple[str, str]]]:
    """[(command, documented output)] per ```console block that runs curl."""
    blocks = []
    for body in re.findall(r"```console\n(.*?)```", text, re.S):
        commands, current = [], None
        for line in body.splitlines():
            if line.startswith("$ "):
                current = [line[2:], []]
                commands.append(current)
            elif current is not None and current[0].endswith("\\") and not current[1]:
                current[0] += "\n" + line
            elif current is not None:
                current[1].append(line)
        pairs = [(cmd, "\n".join(out).strip()) for cmd, out in commands]
        if any("curl" in cmd for cmd, _ in pairs):
            blocks.append(pairs)
    return blocks


def strip_comment(command: str) -> str:
    return re.sub(r"\s+# [^'\"]*$", "", command)


def parse_documented(text: str):
    """The README's JSON, where `...` stands for "more elements/keys"; None if it is not JSON."""
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
    """Non-JSON output: the same lines with every number allowed to differ."""
    shape = lambda s: [re.sub(r"[-+]?\d+(\.\d+)?(e[-+]?\d+)?", "#", line) for line in s.strip().splitlines()]
    assert shape(got) == shape(doc)


# ---------------------------------------------------------------------------- the system

@pytest.fixture(scope="module")
def system(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("readme") / "data"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("BERT_") and k != "REDIS_URL"}
    log = open(data_dir.parent / "bert-up.log", "w")
    proc = subprocess.Popen([str(BERT), "up", "--data-dir", str(data_dir), "--port", str(port),
                             "--bootstrap-steps", "3"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait(lambda: httpx.get(f"{url}/ready").status_code == 200, 240, "/ready", proc, log)
        wait(lambda: bootstrap_state(url) in ("succeeded", "failed"), 420, "the bootstrap job", proc, log)
        assert bootstrap_state(url) == "succeeded", (data_dir.parent / "bert-up.log").read_text()[-3000:]
        yield port
    finally:
        proc.send_signal(signal.SIGTERM)  # as Ctrl-C would: the worker hands its job back
        try:
            proc.wait(150)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


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


def run_block(pairs: list[tuple[str, str]], port: int) -> list[tuple[str, int, str]]:
    """Run a block's commands in one bash process; [(command, exit status, output)]."""
    script = ["set -o pipefail"]
    for i, (command, _) in enumerate(pairs):
        if not command.lstrip().startswith(RUNNABLE):
            command = "true"  # `make run` and the like are not run here
        command = strip_comment(command.replace("localhost:8000", f"localhost:{port}"))
        script += [f"echo '@@@START {i}'", command, f"echo; echo \"@@@END {i} $?\""]
    proc = subprocess.run(["bash", "-c", "\n".join(script)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    results = []
    for i, (command, _) in enumerate(pairs):
        m = re.search(rf"@@@START {i}\n(.*?)\n@@@END {i} (\d+)", proc.stdout, re.S)
        assert m, f"no output for {command!r}: {proc.stdout[-2000:]} {proc.stderr[-2000:]}"
        results.append((command, int(m.group(2)), m.group(1).strip()))
    return results


def test_readme_examples_run_and_print_what_the_readme_shows(system):
    blocks = console_blocks((ROOT / "README.md").read_text())
    assert len(blocks) >= 2 and sum(len(b) for b in blocks) >= 12
    checked = 0
    for pairs in blocks:
        for (command, status, got), (_, documented) in zip(run_block(pairs, system), pairs):
            if not command.lstrip().startswith(RUNNABLE):
                continue
            assert status == 0, f"{command}\nexit {status}: {got[:2000]}"
            if not documented:
                continue
            doc = parse_documented(documented)
            try:
                if doc is None:
                    same_text_shape(documented, got)
                else:
                    same_shape(doc, json.loads(got))
            except (AssertionError, ValueError) as e:
                raise AssertionError(f"{command}\nREADME shows:\n{documented}\ngot:\n{got[:3000]}\n{e}") from None
            checked += 1
    assert checked >= 12
