"""The documentation's reference tables, rendered from the code that declares them and written into the pages.

A table sits between two marker comments, so a page reads whole as a file (on a code host too), and
`make docs-tables` (`python -m docs.tables`) rewrites what lies between them; tests/test_docs.py fails
when a page's table is not what the code renders:

    <!-- generated: service-settings -->   app/settings.py's Settings (bert serve, bert up)
    <!-- generated: worker-settings -->    worker/settings.py's WorkerSettings (bert worker)
    <!-- generated: error-kinds -->        app/errors.py's STATUS table (error_type -> HTTP status)
    <!-- generated: training-options -->   model/options.py's table (bert pretrain/finetune, POST /jobs)
    <!-- generated: config-bounds -->      model/config.py's SIZE_BOUNDS (what a model's config.json may say)
    <!-- generated: task-options TASK -->  model/options.py's options of fine-tuning task TASK, and its defaults
    ...the table...
    <!-- end generated -->

Each settings row is the environment variable (prefix and aliases as pydantic-settings reads them),
the type, the default and the field's description. A field without a description is a ValueError:
the text belongs beside the field, not here.
"""

from __future__ import annotations

import re
import sys
import types
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # document this checkout, whatever else is installed
    sys.path.insert(0, str(ROOT))

COMMAND = "make docs-tables"
# A marker opens a line; one quoted in a sentence (in `code`) is prose.
REGION = re.compile(r"^(<!-- generated: ([\w -]+?) -->\n)(.*?)^(<!-- end generated -->)$", re.M | re.S)
START = re.compile(r"^<!-- generated: ", re.M)


def render(spec: str) -> str:
    """The table a marker names: `service-settings`, or `task-options TASK`."""
    name, *args = spec.split()
    if name not in GENERATORS:
        raise ValueError(f"<!-- generated: {spec} --> names no table; known: {', '.join(GENERATORS)}")
    return GENERATORS[name](*args).strip()


def render_page(text: str, where: str = "the page") -> str:
    """The page with every generated region holding what the code renders now."""
    if len(START.findall(text)) != len(REGION.findall(text)):
        raise ValueError(f"{where}: a `<!-- generated: NAME -->` line without its `<!-- end generated -->` line")
    return REGION.sub(lambda m: f"{m.group(1)}\n{render(m.group(2))}\n\n{m.group(4)}", text)


def main() -> None:
    """Rewrite the tables of every page of docs/ whose tables differ from what the code renders."""
    for page in sorted((ROOT / "docs").glob("*.md")):
        text = page.read_text()
        fresh = render_page(text, page.name)
        if fresh != text:
            page.write_text(fresh)
            print(f"rewrote the tables of {page.relative_to(ROOT)}")


def task_options(task: str) -> str:
    from model.options import TASKS, task_options_markdown

    if task not in TASKS:
        raise ValueError(f"task-options names {task!r}, which is no fine-tuning task ({', '.join(TASKS)})")
    return task_options_markdown(task)


def service_settings() -> str:
    from app.settings import Settings

    return settings_table(Settings)


def worker_settings() -> str:
    from worker.settings import WorkerSettings

    return settings_table(WorkerSettings)


def error_kinds() -> str:
    from app.errors import RETRY_AFTER_S, STATUS

    rows = ["| `error_type` | HTTP status | `Retry-After` |", "|---|---|---|"]
    for kind, status in sorted(STATUS.items(), key=lambda kv: kv[1]):
        retry = f"{RETRY_AFTER_S[status]} s" if status in RETRY_AFTER_S else ""
        rows.append(f"| `{kind}` | {status} | {retry} |")
    return "\n".join(rows)


def settings_table(cls) -> str:
    prefix = cls.model_config.get("env_prefix", "")
    rows = ["| Variable | Type | Default | Meaning |", "|---|---|---|---|"]
    for name, field in cls.model_fields.items():
        if not field.description:
            raise ValueError(
                f"{cls.__module__}.{cls.__name__}.{name} has no description: add Field(description=...) beside it"
            )
        rows.append(
            f"| {env_names(prefix, name, field)} | {type_name(field.annotation)} | "
            f"{default(field)} | {field.description} |"
        )
    return "\n".join(rows)


def env_names(prefix: str, name: str, field) -> str:
    alias = field.validation_alias
    names = list(alias.choices) if alias is not None and hasattr(alias, "choices") else [f"{prefix}{name}".upper()]
    first, *others = names
    return f"`{first}`" + "".join(f" (or `{n}`)" for n in others)


def type_name(annotation) -> str:
    """A reader's name for a field's type: `int`, `path`, `"a" | "b"`, `JSON object of ...`."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        named = [type_name(a) for a in args if a is not type(None)]
        return " \\| ".join(named) + (", optional" if type(None) in args else "")
    if origin is dict:
        return f"JSON object of {type_name(args[1])}"
    return {
        "str": "string",
        "int": "integer",
        "float": "number",
        "bool": "boolean",
        "Path": "path",
        "SecretStr": "secret string",
    }.get(getattr(annotation, "__name__", ""), str(annotation))


def default(field) -> str:
    value = field.get_default(call_default_factory=True)
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, Path) and not value.is_absolute():
        return f"`./{value}`"
    return f"`{value}`"


def training_options() -> str:
    from model.options import options_markdown

    return options_markdown()


def config_bounds() -> str:
    from model.config import SIZE_BOUNDS

    rows = ["| `config.json` field | at most | for comparison |", "|---|---|---|"]
    for name, (most, why) in SIZE_BOUNDS.items():
        field = "`num_labels` (or the entries of `id2label`, `label2id`)" if name == "num_labels" else f"`{name}`"
        rows.append(f"| {field} | {most:,} | {why} |")
    return "\n".join(rows)


GENERATORS = {
    "service-settings": service_settings,
    "worker-settings": worker_settings,
    "error-kinds": error_kinds,
    "training-options": training_options,
    "config-bounds": config_bounds,
    "task-options": task_options,
}


if __name__ == "__main__":
    main()
