"""Training options are declared once (model/options.py): `bert finetune --help`, the OpenAPI schema of
POST /jobs, the console's job form and the run specs show and use the same defaults per task; the same
fine-tune through `bert finetune` and through POST /jobs (real uvicorn, real worker) trains the same;
and `bert --help` answers without importing torch.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import httpx
import pytest

from model.options import OPTIONS, TASKS, options_markdown
from tests.helpers import REDIS_URL, flush_redis, labelled_csv, make_data_dir, start_server, start_worker, wait_state

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
COMMANDS = [
    "pretrain",
    "finetune",
    "evaluate",
    "vocab",
    "import",
    "info",
    "serve",
    "up",
    "init",
    "worker",
    "corpus",
    "corpus build",
]


def bert(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app.cli", *args], capture_output=True, text=True, env=ENV)


def subparser(command: str):
    from app.cli import build_parser

    parser = build_parser()
    for part in command.split():
        parser = next(a for a in parser._actions if a.dest in ("command", "corpus_command")).choices[part]
    return parser


def option_helps(command: str) -> dict[str, str]:
    """{first flag: its help as `bert COMMAND --help` prints it, "(default: ...)" included}."""
    parser = subparser(command)
    return {
        a.option_strings[0]: parser._get_formatter()._expand_help(a) if a.help else ""
        for a in parser._actions
        if a.option_strings and a.dest != "help"
    }


def help_defaults(command: str, printed: str) -> dict[str, str]:
    """{flag: the text of its "(default: ...)"}, checking each help is on the printed page."""
    page = re.sub(r"\s+", "", printed)
    out = {}
    for flag, help in option_helps(command).items():
        assert re.sub(r"\s+", "", help) in page, (flag, help)
        if m := re.search(r"\(default: (.*)\)$", help):
            out[flag] = m.group(1)
    return out


def per_task(shown: str, task: str) -> str:
    """`2e-05 (question-answering: 5e-05)` -> the default of `task`."""
    overrides = dict(re.findall(r"([a-z-]+): ([^,)]+)", shown.partition(" (")[2]))
    return overrides.get(task, shown.partition(" (")[0])


def same(a, b) -> bool:
    if isinstance(a, bool) or isinstance(b, bool) or a is None or b is None:
        return a == b or str(a).lower() == str(b).lower()
    try:
        return float(a) == float(b)
    except (TypeError, ValueError):
        return str(a).lower() == str(b).lower()


def as_shown(value) -> str:
    return "unset" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


@pytest.fixture(scope="module")
def surfaces(tmp_path_factory):
    """The fine-tune defaults as `bert finetune --help`, GET /openapi.json and /console/job-form.json show them."""
    from tests.app.test_jobs_api import make_client

    proc = bert("finetune", "--help")
    assert proc.returncode == 0, proc.stderr
    with make_client(make_data_dir(tmp_path_factory.mktemp("options") / "data")) as client:
        schema = client.get("/openapi.json").json()
        form = client.get("/console/job-form.json").json()
    return help_defaults("finetune", proc.stdout), schema["components"]["schemas"]["FinetuneParams"]["properties"], form


@pytest.mark.parametrize("task", TASKS)
def test_help_openapi_form_and_the_run_spec_agree_on_every_fine_tune_default(surfaces, task):
    from model.training.runs import FinetuneSpec

    cli, openapi, form = surfaces
    form = {f["name"]: f for f in form["finetune"]}
    spec = FinetuneSpec.from_dict({"train_file": "t.csv", "from_model": "m", "out": "o", "task": task})
    used = {**{k: v for k, v in vars(spec).items() if k != "train"}, **spec.train.to_dict()}
    flags = {o.name: o.cli_flag for o in OPTIONS if o.cli}
    compared = 0
    for name, prop in openapi.items():
        if name not in used or name == "task":  # the service's own (devices, max_runtime); the one chosen
            continue
        api_default = prop.get("x-task-defaults", {}).get(task, prop.get("default"))
        form_default = form[name].get("task_defaults", {}).get(task, form[name]["default"])
        assert same(api_default, used[name]), (task, name, api_default, used[name])
        assert same(form_default, used[name]), (task, name, form_default, used[name])
        if name in flags:
            assert same(per_task(cli[flags[name]], task), as_shown(used[name])), (task, name, cli[flags[name]])
        compared += 1
    assert compared >= 20
    # warmup: --warmup's help says the ratio and the steps the run uses
    assert f"{used['warmup_ratio']:g} of the run" in cli["--warmup"] and used["warmup_steps"] is None


def test_the_api_accepts_every_job_option_the_cli_has(surfaces):
    cli, openapi, _ = surfaces
    flags = {o.cli_flag: o.name for o in OPTIONS if "finetune" in o.kinds and o.cli}
    cli_only = {name for flag, name in flags.items() if flag in cli and name not in openapi}
    assert cli_only == {o.name for o in OPTIONS if "finetune" in o.kinds and not o.job}
    assert cli_only == {"device", "text_column", "text_pair_column", "label_column", "group_column"}
    assert {"regression", "epochs", "warmup_ratio", "max_grad_norm", "max_answer_len"} <= openapi.keys()


def edges(option) -> list[tuple[object, bool]]:
    """(value, taken) at and just past each of an option's bounds."""
    step = 1 if option.type is int else 1e-6
    b, out = option.bounds(None), []
    for key, past in (("minimum", -step), ("maximum", step)):
        if key in b:
            out += [(option.type(b[key]), True), (option.type(b[key] + past), False)]
    for key, inside in (("above", step), ("below", -step)):
        if key in b:
            out += [(option.type(b[key]), False), (option.type(b[key] + inside), True)]
    return out


@pytest.mark.parametrize("option", [o for o in OPTIONS if o.trainer and o.bounds(None)], ids=lambda o: o.name)
def test_train_config_checks_the_bounds_the_table_declares(option):
    """A run built in Python (no API, no CLI parsing) is held to the same bounds: a ValueError quoting the value."""
    from model.training.trainer import TrainConfig

    for value, taken in edges(option):
        config = {"max_steps": 10, option.name: value}
        if taken:
            assert getattr(TrainConfig(**config), option.name) == value
            continue
        with pytest.raises(ValueError) as e:
            TrainConfig(**config)
        assert str(e.value).startswith(f"{option.name} must be ") and str(e.value).endswith(f", got {value!r}")


def test_options_markdown_has_a_table_per_kind_with_every_option():
    text = options_markdown()
    assert text.count("| option | flag | type | default | bounds | job | description |") == 2
    pretrain, finetune = text.split("### finetune")
    assert "| `lr` | `--lr` | float | 0.0001 |" in pretrain
    assert "| `lr` | `--lr` | float | 2e-05 (question-answering: 5e-05) |" in finetune
    assert "`nsp`" in pretrain and "`nsp`" not in finetune and "`regression`" in finetune
    for o in OPTIONS:
        assert f"| `{o.name}` |" in text


# -- the CLI answers --help without torch ----------------------------------------------------------

PROBE = """
import sys
from app.cli import main
try:
    main(sys.argv[1:])
except SystemExit as e:
    code = e.code
print("\\nEXIT", code, "TORCH" if "torch" in sys.modules else "NO-TORCH")
"""


@pytest.mark.parametrize("command", ["", *COMMANDS])
def test_help_imports_no_torch_and_every_option_shows_its_default(command):
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, *command.split(), "--help"], capture_output=True, text=True, env=ENV
    )
    assert proc.stdout.rstrip().endswith("EXIT 0 NO-TORCH"), proc.stdout[-500:] + proc.stderr
    if not command or command == "corpus":
        return
    parser = subparser(command)
    for action in parser._actions:
        if action.dest == "help" or not action.option_strings:
            continue
        help = option_helps(command)[action.option_strings[0]]
        assert help, (command, action.option_strings)
        assert action.required or "default" in help, (command, action.option_strings, help)


def test_version_is_the_installed_distributions():
    from importlib.metadata import version

    proc = bert("--version")
    assert proc.returncode == 0 and proc.stdout == f"bert {version('bertserve')}\n"


def test_options_module_needs_only_the_standard_library():
    code = (
        "import sys; before = set(sys.modules); import model.options; "
        "print(sorted(m for m in set(sys.modules) - before if not m.startswith('model')))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV)
    assert proc.returncode == 0, proc.stderr
    assert all(m.split(".")[0] in sys.stdlib_module_names for m in eval(proc.stdout)), proc.stdout


# -- the same fine-tune through the CLI and through POST /jobs ------------------------------------


@pytest.mark.slow
def test_the_same_fine_tune_through_bert_finetune_and_post_jobs_trains_the_same(tmp_path):
    """Only what the tiny model needs is set (a sequence length it has positions for, a line per step);
    lr, warmup, epochs, batch size, seed and the held-out share are the defaults of both."""
    flush_redis()
    data_dir = make_data_dir(tmp_path / "data")
    server, url = start_server(data_dir, REDIS_URL, tmp_path)
    worker = start_worker(data_dir, REDIS_URL, "options", tmp_path)
    try:
        with httpx.Client(base_url=url, timeout=30) as client:
            r = client.post(
                "/datasets",
                files={"file": ("reviews.csv", labelled_csv())},
                data={"name": "reviews", "kind": "labelled"},
            )
            assert r.status_code == 201, r.text
            r = client.post(
                "/jobs",
                json={
                    "kind": "finetune",
                    "model_name": "reviews-clf",
                    "base_model": "tiny",
                    "dataset": "reviews",
                    "params": {"max_seq_len": 32, "log_every": 1},
                },
            )
            assert r.status_code == 202, r.text
            job = wait_state(client, r.json()["id"], {"succeeded", "failed", "cancelled"}, timeout=120)
            assert job["state"] == "succeeded", job
    finally:
        worker.stop()
        server.stop()
        flush_redis()
    job_dir = data_dir / "jobs" / job["id"]
    assert json.loads((job_dir / "job.json").read_text())["params"] == {
        "max_seq_len": 32,
        "log_every": 1,
        "devices": 1,
        "max_runtime": json.loads((job_dir / "job.json").read_text())["params"]["max_runtime"],
    }  # only what the request set

    proc = bert(
        "finetune",
        "--from",
        str(data_dir / "models" / "tiny"),
        "--train",
        str(data_dir / "datasets" / "reviews" / "data.csv"),
        "--out",
        str(tmp_path / "cli"),
        "--max-seq-len",
        "32",
        "--log-every",
        "1",
        "--device",
        "cpu",
        "--threads",
        "1",
    )
    assert proc.returncode == 0, proc.stderr

    def curve(run_dir):
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return [(r["type"], r["step"], r.get("epoch"), r.get("lr"), r["loss"]) for r in records]

    api, cli = curve(job_dir), curve(tmp_path / "cli")
    # 36 training rows (10% held out), batch 32: 2 steps an epoch, 3 epochs; lr 2e-5 after 10% warmup.
    assert [(t, s) for t, s, *_ in cli] == [("train", s) for s in range(1, 7)] + [("eval", 6)]
    assert max(lr for t, _, _, lr, _ in cli if t == "train") == pytest.approx(2e-5, rel=0.2)
    assert [(t, s, e) for t, s, e, _, _ in api] == [(t, s, e) for t, s, e, _, _ in cli]
    for (_, _, _, lr_api, loss_api), (_, _, _, lr_cli, loss_cli) in zip(api, cli):
        assert lr_api == pytest.approx(lr_cli, rel=1e-9, abs=0) if lr_cli is not None else lr_api is None
        assert loss_api == pytest.approx(loss_cli, rel=1e-5, abs=1e-6)


def test_a_list_option_takes_a_non_empty_list_of_its_items_within_their_bounds_or_choices():
    from model.options import Option, check_task_options, check_value, format_default, type_name

    dims = Option("dims", list, "dims", items=int, minimum=1, nullable=True)
    modes = Option("modes", list, "modes", items=str, choices=("a", "b"), default=("a",))
    for value in (None, [4, 1], (8,)):
        check_value(dims, value)
    for value, message in (
        ([], "dims must be a non-empty list of an integer >= 1, got []"),
        ([2, 0], "dims must be a non-empty list of an integer >= 1, got [2, 0]"),
        ([True], "dims must be a non-empty list of an integer >= 1, got [True]"),
        ("4", "dims must be a non-empty list of an integer >= 1, got '4'"),
    ):
        with pytest.raises(ValueError) as e:
            check_value(dims, value)
        assert str(e.value) == message
    check_value(modes, ["b", "a"])
    with pytest.raises(ValueError) as e:
        check_value(modes, ["c"])
    assert str(e.value) == "modes must be a non-empty list of a | b, got ['c']"
    assert (type_name(dims), format_default(modes, "finetune")) == ("list of int", "a")
    check_task_options("token-classification", {"regression": False, "doc_stride": None, "max_query_length": 64})
    with pytest.raises(ValueError) as e:
        check_task_options("token-classification", {"max_query_length": 32})
    assert str(e.value) == "max_query_length is for task question-answering, not token-classification"
