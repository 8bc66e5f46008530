"""The documentation's own rules, checked without a server (tests/test_readme.py runs the examples):
every shell block is a ```console block that runs or carries a skip marker its commands justify, the
files the examples name exist, the generated tables are what the code renders and cover its settings and
error kinds, README and the home page link every page, the pages speak to users only, and the site builds
with `mkdocs build --strict`."""

from __future__ import annotations

import difflib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from app.errors import STATUS
from app.settings import Settings
from docs import tables
from tests.test_readme import ROOT, SKIP_REASONS, commands, fenced_blocks, pages
from worker.settings import WorkerSettings

PAGES = pages()
PROMPT = re.compile(r"^\$ ", re.M)


def page_id(page: Path) -> str:
    return page.name


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_shell_block_is_a_console_block(page):
    for lang, body, _ in fenced_blocks(page.read_text()):
        if PROMPT.search(body) or lang in ("bash", "sh", "shell"):
            assert lang == "console", f"{page.name}: a shell block must be ```console (so it runs):\n{body[:300]}"


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_skip_markers_are_used_only_on_blocks_that_cannot_run(page):
    text = page.read_text()
    for marker in re.findall(r"(?<!`)<!-- docs-test: skip ([^>]*?) -->", text):  # not one quoted in `code`
        assert marker in SKIP_REASONS, f"{page.name}: unknown skip reason {marker!r}; known: {sorted(SKIP_REASONS)}"
    for lang, body, skip in fenced_blocks(text):
        if skip is None:
            continue
        assert lang == "console", f"{page.name}: a skip marker above a ```{lang} block (only console blocks run)"
        cmds = [cmd for cmd, _ in commands(body)]
        assert cmds, f"{page.name}: a skip marker above a block without commands"
        for cmd in cmds:
            assert SKIP_REASONS[skip].search(cmd), f"{page.name}: `{cmd}` is skipped as {skip!r} but does not need it"
    assert len(re.findall(r"(?<!`)<!-- docs-test: skip", text)) == sum(
        skip is not None for _, _, skip in fenced_blocks(text)
    ), f"{page.name}: a skip marker that is not on the line right above a block"


def test_the_skip_check_catches_a_runnable_block_marked_skipped():
    assert not SKIP_REASONS["docker"].search("curl -s localhost:8000/health")
    assert not SKIP_REASONS["gpu"].search(".venv/bin/bert pretrain --corpus corpus.txt --out runs/x")
    assert not SKIP_REASONS["multi-node"].search(".venv/bin/bert pretrain --nproc-per-node 2")
    assert not SKIP_REASONS["make"].search("curl -s localhost:8000/ready")
    assert not SKIP_REASONS["kubernetes"].search("curl -s localhost:8000/ready")


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_the_example_files_exist(page):
    for path in set(re.findall(r"examples/[\w./-]+\w", page.read_text())):
        assert (ROOT / path).exists(), f"{page.name} names {path}, which the repository does not have"


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_the_generated_tables_are_what_the_code_renders(page):
    text = page.read_text()
    fresh = tables.render_page(text, page.name)
    diff = difflib.unified_diff(text.splitlines(), fresh.splitlines(), "page", "code", n=0, lineterm="")
    shown = "\n".join(list(diff)[:20])
    assert fresh == text, f"{page.name}: its generated tables differ from the code: run `{tables.COMMAND}`\n{shown}"


def test_a_stale_or_unclosed_table_is_caught():
    page = (ROOT / "docs" / "configuration.md").read_text()
    row = "| `BERT_MAX_BATCH_TOKENS` | integer | `4096` |"
    stale = page.replace(row, row.replace("4096", "2048"))
    assert stale != page and tables.render_page(stale) == page
    with pytest.raises(ValueError, match="without its `<!-- end generated -->` line"):
        tables.render_page(page.replace("<!-- end generated -->", "", 1))
    with pytest.raises(ValueError, match="names no table"):
        tables.render_page("<!-- generated: settings -->\n<!-- end generated -->\n")
    quoted = "Tables sit between\n`<!-- generated: NAME -->` and `<!-- end generated -->` lines.\n"
    assert tables.render_page(quoted) == quoted  # a marker quoted in a sentence is prose


def test_the_configuration_page_is_generated_from_both_settings_objects():
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert "<!-- generated: service-settings -->" in page and "<!-- generated: worker-settings -->" in page
    service, worker = tables.service_settings(), tables.worker_settings()
    for name in Settings.model_fields:
        assert f"`BERT_{name.upper()}`" in service, name
    for name in WorkerSettings.model_fields:
        assert f"`BERT_{name.upper()}`" in worker, name
    assert "`BERT_BROKER_URL` (or `REDIS_URL`)" in service
    assert "| `BERT_MAX_BATCH_TOKENS` | integer | `4096` |" in service
    assert "| `BERT_DEFAULT_MODEL` | string, optional | unset |" in service


@pytest.mark.parametrize("name", ["data_dir", "broker_url"])
def test_the_service_and_the_workers_read_a_shared_setting_alike(name):
    """One variable, type and default (worker/queue.py's), each in its table once, with each side's own description."""
    service, worker = Settings.model_fields[name], WorkerSettings.model_fields[name]
    assert (service.annotation, service.validation_alias) == (worker.annotation, worker.validation_alias)
    assert service.get_default(call_default_factory=True) == worker.get_default(call_default_factory=True)
    assert service.description != worker.description
    for table in (tables.service_settings(), tables.worker_settings()):
        assert table.count(f"`BERT_{name.upper()}`") == 1


def test_a_setting_without_a_description_fails_the_build():
    from pydantic_settings import BaseSettings

    class Undocumented(BaseSettings):
        knob: int = 3

    with pytest.raises(ValueError, match="knob has no description"):
        tables.settings_table(Undocumented)


def test_the_error_table_lists_every_kind_of_the_code():
    assert "<!-- generated: error-kinds -->" in (ROOT / "docs" / "using.md").read_text()
    table = tables.error_kinds()
    rows = re.findall(r"^\| `(\w+)` \| (\d+) \|", table, re.M)
    assert {kind: int(status) for kind, status in rows} == STATUS
    assert "| `conflict` | 409 |" in table


def section(text: str, heading: str) -> str:
    """A page's text from `heading` to the next heading of its level."""
    level = heading.split(" ")[0] + " "
    start = text.index(f"\n{heading}\n")
    end = text.find(f"\n{level}", start + len(heading) + 2)
    return text[start : end if end != -1 else len(text)]


@pytest.mark.parametrize(
    ("home", "heading", "prefix"), [("README.md", "## Documentation", "docs/"), ("docs/index.md", "## The pages", "")]
)
def test_the_front_pages_list_every_page_of_the_site(home, heading, prefix):
    """README's list of pages and the home page's table name every page of mkdocs.yml's nav, in its order."""
    listed = re.findall(rf"\]\({re.escape(prefix)}([\w-]+\.md)\)", section((ROOT / home).read_text(), heading))
    nav = [page.name for page in PAGES[1:] if page.name != Path(home).name]  # the home page lists the others
    assert listed == nav, f"{home}'s {heading!r} lists {listed}; mkdocs.yml's nav has {nav}"


HISTORY = [
    (r"\bissue\s*#?\d+|\bissue's\b", "an issue reference"),
    (r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b", "a commit hash"),
    (r"\.\./shared|/work/", "a path outside the repository"),
    (r"seed project|lent to this project|to this project so far", "how the project was made"),
    (r"\b\d+ tests\b", "a test count (it goes stale)"),
]


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_pages_speak_to_users_only(page):
    text = page.read_text()
    prose = re.sub(r"^```.*?^```|`[^`\n]*`", "", text, flags=re.S | re.M)  # example outputs hold ids and digests
    for pattern, what in HISTORY:
        m = re.search(pattern, prose if what == "a commit hash" else text, re.I)
        assert m is None, f"{page.name}: {what}: {m.string[max(0, m.start() - 60) : m.end() + 60]!r}"


def test_the_site_builds_strictly(tmp_path):
    pytest.importorskip("mkdocs", reason="the docs extra (pip install -e '.[docs]'); make installs it")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "site" / "configuration" / "index.html").exists()


def test_the_configuration_page_shows_the_training_options_table():
    from model.options import OPTIONS

    assert "<!-- generated: training-options -->" in (ROOT / "docs" / "configuration.md").read_text()
    table = tables.training_options()
    assert {f"`{o.name}`" for o in OPTIONS} <= {cell.strip() for line in table.splitlines() for cell in line.split("|")}


def test_the_models_page_shows_what_an_import_checks():
    from model.config import MAX_CONFIG_BYTES, SIZE_BOUNDS
    from model.model_dir import MAX_IMPORT_WEIGHT_BYTES, MAX_TEXT_FILE_BYTES
    from model.sources import MAX_ARCHIVE_MEMBERS, MAX_EXTRACT_BYTES

    page = (ROOT / "docs" / "models.md").read_text()
    assert "<!-- generated: config-bounds -->" in page
    table = tables.config_bounds()
    assert all(f"`{name}`" in table and f"| {most:,} |" in table for name, (most, _) in SIZE_BOUNDS.items())
    section = page[page.index("## What an import checks") :]
    for limit in (
        f"`config.json` is at most {MAX_CONFIG_BYTES >> 20} MiB",
        f"and {MAX_IMPORT_WEIGHT_BYTES >> 30} GiB with",
        f"are at most {MAX_TEXT_FILE_BYTES >> 20} MiB each",
        f"at most {MAX_ARCHIVE_MEMBERS:,} members and {MAX_EXTRACT_BYTES >> 30} GiB in all",
    ):
        assert limit in " ".join(section.split()), limit


def test_a_tasks_options_table_is_generated_from_its_options():
    from model.options import OPTIONS

    page = (ROOT / "docs" / "training.md").read_text()
    assert "<!-- generated: task-options sentence-embedding -->" in page
    table = tables.task_options("sentence-embedding")
    assert table.strip() in page
    for o in OPTIONS:
        if (o.tasks and "sentence-embedding" in o.tasks) or "sentence-embedding" in o.by_task:
            assert f"| `{o.name}` | `{o.cli_flag}` |" in table, o.name
    assert "| `batch_size` | `--batch-size` | int | 64 |" in table and "| `doc_stride` |" not in table
    assert (
        "| `loss` | `--loss` | str | unset | mnrl \\| cosent \\| bce |" in table
    )  # a choice's bar does not end the cell
    with pytest.raises(ValueError, match="no fine-tuning task"):
        tables.task_options("ner")
