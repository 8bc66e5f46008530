"""The rooms' walls: import-linter's contracts (pyproject.toml) hold on this tree and catch violations on a
tree that breaks them, no project module takes part in an import cycle (module- or function-level), one
module alone writes a job's state and lifecycle events, and a fact that several modules use is declared
in one."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
PACKAGES = ("datadir", "model", "app", "worker")


def lint_imports(cwd: Path, pythonpath: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    return subprocess.run(
        [str(LINT_IMPORTS), str(ROOT / "pyproject.toml"), "--no-cache"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
    )


def import_cycles(*packages: str) -> list[list[str]]:
    """Strongly connected components (size > 1) of the direct-import graph between the packages' modules;
    grimp reads every import statement, those inside functions too."""
    graph = grimp.build_graph(*packages, cache_dir=None)
    modules = sorted(m for m in graph.modules if m.split(".")[0] in packages)
    edges = {m: sorted(n for n in graph.find_modules_directly_imported_by(m) if n in modules) for m in modules}
    return _strongly_connected(edges)


def _strongly_connected(edges: dict[str, list[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iteratively; only components with a cycle (more than one module)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(edges[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(edges[child])))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def test_this_tree_keeps_every_contract():
    proc = lint_imports(ROOT, ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 broken" in proc.stdout


def test_no_project_module_is_in_an_import_cycle():
    assert import_cycles(*PACKAGES) == []


# A small tree with the same three packages that breaks each contract once.
BROKEN_TREE = {
    "model/__init__.py": "",
    "model/training/__init__.py": "",
    "model/modeling.py": "import torch\n",
    "model/training/trainer.py": "import argparse\nfrom . import runs\n",  # a CLI framework in model/, and a cycle
    "model/training/runs.py": "def run():\n    from . import trainer  # a function-level import closes the cycle\n",
    "datadir/__init__.py": "",
    "datadir/jobs.py": "from model import modeling\n",  # the ground floor reaches up into model/ (and torch)
    "app/__init__.py": "",
    "app/jobs/__init__.py": "",
    "app/jobs/job_service.py": "import worker.queue\nfrom worker.telemetry import tracing\n",  # the allowed crossings ...
    # ... and the settings both sides read; then a shared type reaches up to the CLI
    "app/settings.py": "import worker.queue\nfrom app.cli import main\n",
    "app/serving/__init__.py": "",
    "app/serving/engine.py": "from worker import training\n",  # any other is not
    **{f"app/{room}/__init__.py": "" for room in ("cli", "launcher", "api", "keys")},
    **{f"app/{name}.py": "" for name in ("main", "schemas", "errors", "prometheus")},
    "worker/__init__.py": "",
    "worker/queue.py": "from . import settings\n",  # the queue module is not a leaf
    "worker/settings.py": "",
    "worker/training.py": "import app.jobs.job_service\n",  # worker imports app
    "worker/telemetry/__init__.py": "",
    "worker/telemetry/tracing.py": "from worker import settings\n",  # the shared helpers reach into the worker
    **{
        f"worker/{name}.py": ""
        for name in ("celery_app", "tasks", "recipes", "recovery", "ddp_job", "health", "job_trace")
    },
}


@pytest.fixture(scope="module")
def broken_tree(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("broken")
    for name, text in BROKEN_TREE.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(textwrap.dedent(text))
    return root


def test_each_contract_catches_its_violation(broken_tree):
    proc = lint_imports(broken_tree, broken_tree)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Contracts: 0 kept, 8 broken." in proc.stdout, proc.stdout


def test_the_cycle_check_sees_function_level_imports(broken_tree, monkeypatch):
    monkeypatch.syspath_prepend(str(broken_tree))
    for name in [m for m in sys.modules if m.split(".")[0] in PACKAGES]:
        monkeypatch.delitem(sys.modules, name)
    assert import_cycles(*PACKAGES) == [["model.training.runs", "model.training.trainer"]]


def test_the_app_reaches_into_worker_only_through_leaf_modules():
    """Beyond the named contracts: whatever worker/ grows, app/ imports only worker.queue, which imports
    nothing of the project, and worker.telemetry, which imports only datadir and itself."""
    graph = grimp.build_graph(*PACKAGES, cache_dir=None)
    app_modules = [m for m in graph.modules if m.split(".")[0] == "app"]
    reached = {
        n for m in app_modules for n in graph.find_modules_directly_imported_by(m) if n.split(".")[0] == "worker"
    }
    assert reached - {"worker.telemetry"} == {"worker.queue", "worker.telemetry.logs", "worker.telemetry.tracing"}
    assert not {n for n in graph.find_modules_directly_imported_by("worker.queue") if n.split(".")[0] in PACKAGES}
    telemetry = [m for m in graph.modules if m.startswith("worker.telemetry")]
    beyond = {n for m in telemetry for n in graph.find_modules_directly_imported_by(m) if n.split(".")[0] in PACKAGES}
    assert {n for n in beyond if not n.startswith("worker.telemetry")} <= {"datadir.audit"}


def test_the_data_directory_contract_loads_no_framework_and_no_torch():
    """import-linter sees direct imports; this runs the import (package __init__ files included)."""
    code = (
        "import sys, datadir; heavy = {'torch', 'numpy', 'fastapi', 'celery', 'kombu', 'pydantic'}; "
        "print(sorted(heavy & set(sys.modules)))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


# File names that two modules share because they mean the same thing: each process's settings, each
# package's error type, and a resource's HTTP routes beside its on-disk contract in datadir.
SAME_MEANING = {
    "settings.py": {"app/settings.py", "worker/settings.py"},
    "errors.py": {"app/errors.py", "model/errors.py"},
    "jobs.py": {"app/api/routes/jobs.py", "datadir/jobs.py"},
    "datasets.py": {"app/api/routes/datasets.py", "datadir/datasets.py"},
}
# And a route module's request and response types, in app/schemas/ under its name.
SCHEMAS, ROUTES = "app/schemas/", "app/api/routes/"


def test_no_two_modules_share_a_file_name_unless_they_mean_the_same_thing():
    by_name: dict[str, set[str]] = {}
    for package in ("app", "datadir", "model", "worker", "bench"):
        for path in (ROOT / package).rglob("*.py"):
            if path.name not in ("__init__.py", "__main__.py"):
                by_name.setdefault(path.name, set()).add(path.relative_to(ROOT).as_posix())
    by_name = {name: _types_beside_their_routes(paths) for name, paths in by_name.items()}
    shared = {name: paths for name, paths in by_name.items() if len(paths) > 1}
    assert shared == {name: paths for name, paths in SAME_MEANING.items() if name in shared}, shared


def _types_beside_their_routes(paths: set[str]) -> set[str]:
    """The paths less app/schemas/X.py where app/api/routes/X.py is there: a route module's request and
    response types, under its name, mean the same resource."""
    return {p for p in paths if not (p.startswith(SCHEMAS) and p.replace(SCHEMAS, ROUTES, 1) in paths)}


def test_each_module_of_types_sits_beside_its_routes():
    """app/schemas/X.py holds the types of app/api/routes/X.py; shared.py what several of them share."""
    names = {path.name for path in (ROOT / SCHEMAS).glob("*.py")} - {"__init__.py", "shared.py"}
    assert names and names <= {path.name for path in (ROOT / ROUTES).glob("*.py")}
    (docstring,) = ast.parse((ROOT / SCHEMAS / "__init__.py").read_text()).body  # no re-exports: one home per type
    assert isinstance(docstring, ast.Expr) and isinstance(docstring.value, ast.Constant)


# Facts that several modules use, each declared (assigned, or defined as a function) in one module only.
ONE_HOME = {
    "IGNORE_INDEX": "model/modeling.py",
    "SPECIAL_TOKENS_IN_ONE_TEXT": "model/tokenizer.py",  # [CLS] a [SEP]
    "SPECIAL_TOKENS_IN_A_PAIR": "model/tokenizer.py",  # [CLS] a [SEP] b [SEP]
    "with_special_tokens": "model/tokenizer.py",
    "check_window": "model/data/question_answering.py",  # a QA window holds the question and moves on
    "NAME_PATTERN": "datadir/layout.py",  # models' and datasets' names
    "NAME_RULE": "datadir/layout.py",
    "NAME_MAX_LENGTH": "datadir/layout.py",
    "KEY_NAME_PATTERN": "app/keys/keyfile.py",  # keys' names: a rule of their own
    "VISIBILITY_TIMEOUT_S": "worker/queue.py",  # the broker's, for the workers and the publisher
    "DataDirSetting": "worker/queue.py",  # BERT_DATA_DIR, for the service's settings and the workers'
    "BrokerUrlSetting": "worker/queue.py",  # BERT_BROKER_URL (or REDIS_URL), the same
    "LogFormatSetting": "worker/queue.py",  # BERT_LOG_FORMAT, the same
    "escape_for_log": "worker/telemetry/logs.py",  # a log line's controls and line separators, escaped
}


@pytest.mark.parametrize("name", ONE_HOME)
def test_a_fact_is_declared_in_one_module(name):
    declaring = [
        path.relative_to(ROOT).as_posix()
        for package in ("app", "datadir", "model", "worker")
        for path in (ROOT / package).rglob("*.py")
        if re.search(rf"^\s*(def {name}\(|{name}\s*[:=])", path.read_text(), re.M)
    ]
    assert declaring == [ONE_HOME[name]]


def test_bert_variables_are_read_through_the_settings_objects():
    """A BERT_* variable is a field of app/settings.py's Settings or worker/settings.py's WorkerSettings, so the
    docs' configuration tables list it; no module reads one from os.environ by hand."""
    by_hand = re.compile(r"""(environ|getenv)\b.*["']BERT_""")
    readers = [
        path.relative_to(ROOT).as_posix()
        for package in PACKAGES
        for path in (ROOT / package).rglob("*.py")
        if by_hand.search(path.read_text())
    ]
    assert readers == []


# -- one owner of a job's state --------------------------------------------------------------------

RECORD_KEYS = ("state", "events")  # a job's state and lifecycle events: written only by its transitions
STATE_OWNER = "datadir/jobs.py"


def _key(node: ast.AST) -> str | None:
    """The record key a subscript names (x["state"], x["events"][:-9]), if it is one of RECORD_KEYS."""
    while isinstance(node, ast.Subscript):
        if isinstance(node.slice, ast.Constant) and node.slice.value in RECORD_KEYS:
            return node.slice.value
        node = node.value
    return None


def _targets(node: ast.AST) -> list[ast.AST]:
    if isinstance(node, ast.Assign):
        found = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        found = [node.target]
    elif isinstance(node, ast.Delete):
        found = list(node.targets)
    else:
        return []
    flat = []
    while found:
        target = found.pop()
        if isinstance(target, (ast.Tuple, ast.List)):
            found.extend(target.elts)
        else:
            flat.append(target.value if isinstance(target, ast.Starred) else target)
    return flat


def _writes_record_key(node: ast.AST) -> bool:
    """x["state"] = ..., (x["state"], y) = ..., x.state = ... (x not self), x.update(state=...),
    x.update({"state": ...}), x.setdefault/__setitem__("events", ...), x["events"].append(...), setattr(x, "state", ...)."""
    for target in _targets(node):
        if _key(target) or (
            isinstance(target, ast.Attribute)
            and target.attr in RECORD_KEYS
            and not (isinstance(target.value, ast.Name) and target.value.id == "self")
        ):
            return True
    if not isinstance(node, ast.Call):
        return False
    func, args = node.func, node.args
    first = args[0].value if args and isinstance(args[0], ast.Constant) else None
    if isinstance(func, ast.Name) and func.id == "setattr":
        return len(args) > 1 and isinstance(args[1], ast.Constant) and args[1].value in RECORD_KEYS
    if not isinstance(func, ast.Attribute):
        return False
    if func.attr == "update":
        return any(k.arg in RECORD_KEYS for k in node.keywords) or any(
            isinstance(a, ast.Dict) and any(isinstance(k, ast.Constant) and k.value in RECORD_KEYS for k in a.keys)
            for a in args
        )
    if func.attr in ("setdefault", "__setitem__", "pop"):
        return first in RECORD_KEYS
    return func.attr in ("append", "extend", "insert", "clear", "remove") and _key(func.value) is not None


def record_key_writers(root: Path) -> dict[str, list[int]]:
    """Each module below root's packages that writes a record's state or events: {path: [line, ...]}."""
    found: dict[str, list[int]] = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            lines = sorted({n.lineno for n in ast.walk(tree) if _writes_record_key(n)})
            if lines:
                found[path.relative_to(root).as_posix()] = lines
    return found


def test_one_module_writes_a_jobs_state_and_events():
    """Every other module moves a job through datadir/jobs.py's named transitions."""
    writers = record_key_writers(ROOT)
    assert list(writers) == [STATE_OWNER], f"only {STATE_OWNER} may write a job's state or events: {writers}"


WRITERS = {
    "app/a.py": 'def f(record):\n    record["state"] = "failed"\n',
    "app/b.py": 'def f(r):\n    r["state"], r["error"] = "failed", "x"\n',
    "model/c.py": 'def f(r):\n    r.update(state="running")\n',
    "model/d.py": 'def f(r):\n    r.update({"state": "running"})\n',
    "worker/e.py": 'def f(job):\n    job.state = "queued"\n',
    "worker/f.py": 'def f(r):\n    r["events"].append({"event": "x"})\n',
    "worker/g.py": 'def f(r):\n    r.setdefault("events", []).append({"event": "x"})\n',
    "worker/h.py": 'def f(r):\n    setattr(r, "state", "x")\n',
}
READERS = {
    "app/ok.py": (
        'class Stream:\n    def see(self, record):\n        self.state = record["state"]\n'
        '        return {"state": self.state, "events": record["events"][-3:]}\n'
    ),
}


def test_the_owner_check_sees_every_way_of_writing_the_state(tmp_path):
    for name, text in {**WRITERS, **READERS}.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert record_key_writers(tmp_path) == {name: [2] for name in WRITERS}


# -- one runner for leased work --------------------------------------------------------------------

LEASED_WORK = re.compile(r"\bLease\(|\.try_acquire\(|\.start_heartbeat\(|\b(?:jobs|transitions)\.start\b")
RUNNER = {"datadir/runner.py", "datadir/lease.py"}  # the runner, and the flock it holds (lease_is_free probes)


def modules_holding_leases(root: Path) -> set[str]:
    return {
        path.relative_to(root).as_posix()
        for package in PACKAGES
        for path in (root / package).rglob("*.py")
        if LEASED_WORK.search(path.read_text())
    }


def test_only_the_runner_holds_a_lease_or_starts_an_attempt():
    """Training jobs, imports and batches take their lease, begin and heartbeat through datadir/runner.py."""
    assert modules_holding_leases(ROOT) <= RUNNER
    assert "runner" in (ROOT / "worker" / "training.py").read_text()


def test_the_lease_check_sees_a_second_runner(tmp_path):
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "imports.py").write_text("lease = Lease(store, job_id)\nlease.try_acquire()\n")
    (tmp_path / "worker").mkdir()
    (tmp_path / "worker" / "t.py").write_text("store.move(job_id, jobs.start, 'host:1')\n")
    assert modules_holding_leases(tmp_path) == {"app/imports.py", "worker/t.py"}


# -- docs/architecture.md states what the tree is ----------------------------------------------------

ARCHITECTURE = (ROOT / "docs" / "architecture.md").read_text()


def _tree_entries() -> set[str]:
    """The folders the "Where things are" tree names: top-level ones and those one level in (`app/api`)."""
    tree = ARCHITECTURE.split("## Where things are", 1)[1].split("```")[1]
    entries, top = set(), None
    for line in tree.splitlines():
        match = re.match(r"^( *)([a-z_]+)/ ", line)
        if not match:
            continue
        if not match.group(1):
            top = match.group(2)
            entries.add(top)
        elif top is not None:
            entries.add(f"{top}/{match.group(2)}")
    return entries


def test_the_architecture_page_names_every_package_and_folder():
    packages = set(PACKAGES)
    folders = {
        f"{package}/{child.name}"
        for package in PACKAGES
        for child in (ROOT / package).iterdir()
        if child.is_dir() and ((child / "__init__.py").is_file() or child.name in ("console", "heldout"))
    }
    assert (packages | folders) - {"model/heldout"} <= _tree_entries()


def test_the_architecture_page_names_every_job_kind_and_who_runs_it():
    from datadir.jobs import API_KINDS, JOB_KINDS

    sentence = re.search(r"A job's \*kind\* is one of ([^;]+);", " ".join(ARCHITECTURE.split())).group(1)
    assert re.findall(r"`([\w-]+)`", sentence) == list(JOB_KINDS)
    assert list(JOB_KINDS[-len(API_KINDS) :]) == sorted(API_KINDS, key=JOB_KINDS.index)  # "the API the other three"


def test_the_architecture_page_gives_the_app_rooms_in_the_contracts_order():
    import tomllib

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    layers = next(c["layers"] for c in contracts if c["id"] == "app-rooms")
    text = " ".join(ARCHITECTURE.split())
    stated = re.search(r"Inside `app/` the rooms depend downwards only: (.+?)\. ", text).group(1)
    named = [m.replace(" ", "") for m in re.findall(r"`([a-z_ ]+)`", stated)]
    assert named == [room.replace("app.", "") for layer in layers for room in layer.split(" | ")]


def test_no_module_of_app_passes_600_lines():
    """A module past 600 lines holds more than one thing: split it where it reads best."""
    long = {
        p.relative_to(ROOT).as_posix(): n
        for p in (ROOT / "app").rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 600
    }
    assert long == {}
