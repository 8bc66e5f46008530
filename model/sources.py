"""Where an imported model comes from: a local directory, an archive of one, or a Hugging Face Hub repo.

`import_source` turns any of the three into a published model version: the source's files are
gathered into a directory (`fetch`), validated and converted by model.model_dir's `import_model`
into a staged directory inside DATA_DIR, given a card whose `source` says where they came from, and
published as the next version of the name (datadir.publish_model).

    directory   a Hugging Face layout directory (config.json, weights, vocab.txt or tokenizer.json)
    archive     a .tar, .tar.gz, .tgz or .zip of one, extracted safely: regular files and folders
                only (no links, devices, absolute paths or '..'), at most MAX_ARCHIVE_MEMBERS of them
                and MAX_EXTRACT_BYTES in all, counted as the members are read (a tar's one at a
                time, a zip's from its list before any is extracted)
    hub         a repo id such as google-bert/bert-base-uncased, fetched with huggingface_hub (its
                cache, HF_ENDPOINT, HF_TOKEN, HF_HUB_OFFLINE and progress bar), only the files needed:
                config, tokenizer, sentence-transformers files and ONE weights file

Reference: https://huggingface.co/docs/huggingface_hub/guides/download
"""

from __future__ import annotations

import os
import pickle
import re
import stat
import tarfile
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from datadir.files import TMP_PREFIX
from datadir.publish import NotOwner, publish_model
from model.errors import UserError

# (bytes done, bytes in all) after each downloaded chunk; raising from it stops the import (a cancel).
Progress = Callable[[int, int], None]

SOURCE_KINDS = ("directory", "archive", "hub")
ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".zip")
MAX_EXTRACT_BYTES = 8 << 30  # a BERT-large in fp32 is 1.3 GB; a bound, not a size anyone needs
MAX_ARCHIVE_MEMBERS = 10_000  # a model directory has about ten files
# A zip's central directory (its list of members, read whole before any is extracted): an entry is 46
# bytes and its path, so MAX_ARCHIVE_MEMBERS entries with long paths fit.
MAX_ZIP_DIRECTORY_BYTES = MAX_ARCHIVE_MEMBERS * 256
# A repo id: "name" or "owner/name" (the Hub's rule: letters, digits, '-', '_', '.').
HUB_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,95}(/[A-Za-z0-9][A-Za-z0-9_.-]{0,95})?$"
# A revision: a branch, tag or commit as git names them, and no more (no `..`, no empty path part), so it can
# never climb out of a folder or a URL path that is built from it.
REVISION_MAX_LENGTH = 200
REVISION_RULE = (
    f"must be a branch, tag or commit: 1-{REVISION_MAX_LENGTH} letters, digits, '.', '_', '-' or '/', starting "
    "with a letter or digit, without '..' or '//', and not ending in '/'"
)
# What an import reads from a Hub repo besides the weights; each is fetched when the repo has it. The
# sentence-transformers files (from modules.json on) say how its embeddings are pooled: import_model checks
# them and writes them beside the converted model (model/sentence_modules.py).
HUB_FILES = (
    "config.json",
    "vocab.txt",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "modules.json",
    "sentence_bert_config.json",
    "config_sentence_transformers.json",
    "1_Pooling/config.json",
    "1_SpladePooling/config.json",  # a sparse encoder's (sentence-transformers' SparseEncoder)
    "1_Dense/config.json",  # a ColBERT's (model/late_interaction.py): PyLate's projection
    "1_Dense/model.safetensors",
    "artifact.metadata",  # colbert-ir's settings
)
WEIGHTS = ("model.safetensors", "pytorch_model.bin")  # in order of preference
SHARDED = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
MODEL_TYPES = ("bert",)


@dataclass
class Fetched:
    """A source gathered into a local directory: where, and the card's `source` entry for it."""

    path: Path
    source: dict[str, Any] = field(default_factory=dict)


def source_kind(source: str) -> str:
    """ "directory", "archive" or "hub" for what the user typed; a UserError when it is none of them."""
    path = Path(source)
    if path.is_dir():
        return "directory"
    if path.is_file():
        if source.lower().endswith(ARCHIVE_SUFFIXES):
            return "archive"
        raise UserError(f"{source} is a file but not an archive ({', '.join(ARCHIVE_SUFFIXES)})")
    if is_hub_id(source):
        return "hub"
    raise UserError(f"{source} is neither a directory, an archive nor a Hugging Face Hub repo id (owner/name)")


def is_hub_id(source: str) -> bool:
    return bool(re.fullmatch(HUB_ID_PATTERN, source)) and ".." not in source


def valid_revision(revision: str) -> bool:
    """Whether `revision` follows REVISION_RULE."""
    return (
        len(revision) <= REVISION_MAX_LENGTH
        and re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._/-]*", revision) is not None
        and ".." not in revision
        and "//" not in revision
        and not revision.endswith("/")
    )


def import_source(
    data_dir: str | os.PathLike,
    source: str,
    name: str,
    *,
    revision: str | None = None,
    kind: str | None = None,
    import_id: str | None = None,
    progress: Progress | None = None,
    card_source: dict[str, Any] | None = None,
    memory_budget: int | None = None,
    pooling: str | None = None,
) -> tuple[Path, dict[str, Any]]:
    """Import `source` (of `kind`, else `source_kind(source)`) as the next version of model `name`.

    Returns the published version's directory and its summary (model.model_dir.summarize). Nothing
    is published unless the whole model converted; temp files live in DATA_DIR under TMP_PREFIX and
    are removed either way. `import_id` makes a retried publish idempotent (a job id, for API imports);
    `card_source` adds to (or replaces) the card's source fields (an upload's own file name);
    `memory_budget` is the bytes the service's models may take (model.model_dir.check_config); `pooling`
    "splade" imports a masked-LM model as a sparse encoder (model.model_dir.import_model).
    Errors name the source as the user does (an archive by its file name, a repo by its id) and the
    files in it by their path inside it, never by where they are on this machine.
    """
    from datadir.layout import DataDir, new_job_id
    from model.model_card import write_card
    from model.model_dir import import_model

    DataDir(data_dir).model(name)  # the name rule, before any download
    kind = kind or source_kind(source)
    if kind not in SOURCE_KINDS:
        raise ValueError(f"kind must be one of {SOURCE_KINDS}, got {kind!r}")
    if revision and kind != "hub":
        raise UserError("--revision applies to a Hugging Face Hub repo only")
    label = (card_source or {}).get("file") or (Path(source).name if kind == "archive" else source)
    root = Path(data_dir)
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=TMP_PREFIX + "import-") as work:
        fetched = fetch(
            source,
            kind,
            Path(work) / "source",
            revision=revision,
            progress=progress,
            label=label,
            memory_budget=memory_budget,
        )
        staged = Path(work) / "model"
        try:
            summary = import_model(fetched.path, staged, label=label, memory_budget=memory_budget, pooling=pooling)
        except pickle.UnpicklingError:  # torch.load(weights_only=True) met more than tensors
            raise UserError(
                f"{label}: pytorch_model.bin is not plain weights: loading it would unpickle code, which is refused "
                "(convert it to model.safetensors)"
            ) from None
        except UserError as e:
            raise UserError(str(e).replace(str(fetched.path), label)) from None
        write_card(staged, source={**fetched.source, **(card_source or {})})  # measured before it is served
        try:
            version = publish_model(root, import_id or new_job_id(), staged, name)
        except FileExistsError:  # models/<name> holds something that is not a model
            raise UserError(
                f"models/{name} in the data directory holds something that is not a model (no config.json, "
                "no v<N>/ versions); nothing was imported"
            ) from None
        except NotOwner as e:  # the name is another key's: not the importer's to publish to
            raise UserError(str(e)) from None
    return version, {**summary, "path": str(version)}


def fetch(
    source: str,
    kind: str,
    dest: Path,
    *,
    revision: str | None = None,
    progress: Progress | None = None,
    label: str | None = None,
    memory_budget: int | None = None,
) -> Fetched:
    """Gather the source's model files into a local directory (`dest` is used for archives and Hub links);
    `label` names an archive in errors, `memory_budget` bounds a Hub model before its weights download."""
    if kind == "directory":
        path = Path(source).resolve()
        return Fetched(path, {"kind": "directory", "path": str(path)})
    if kind == "archive":
        archive = Path(source)
        return Fetched(extract_archive(archive, dest, label=label), {"kind": "archive", "file": archive.name})
    return fetch_hub(source, dest, revision=revision, progress=progress, memory_budget=memory_budget)


# -- archives -------------------------------------------------------------------------------------


def extract_archive(archive: Path, dest: Path, max_bytes: int = MAX_EXTRACT_BYTES, label: str | None = None) -> Path:
    """Extract a .tar/.tar.gz/.tgz/.zip into `dest` (`extract_safely`); the model directory in it (`dest`
    itself, or the one folder holding config.json). `label` names the archive in errors (default: its file
    name)."""
    label = label or archive.name
    extract_safely(archive, dest, max_bytes, label=label)
    return _model_root(dest, label)


@dataclass(frozen=True)
class _Caps:
    label: str  # the archive, in errors
    max_bytes: int
    max_members: int
    into: str  # what `dest` is, in the refusal of a member that would leave it


def extract_safely(
    archive: Path,
    dest: Path,
    max_bytes: int,
    *,
    label: str | None = None,
    max_members: int | None = None,
    into: str = "the model directory",
) -> None:
    """Extract a .tar/.tar.gz/.tgz/.zip into `dest`, each member checked before anything of it is written:
    regular files and folders only, none outside `dest`, at most `max_members` (MAX_ARCHIVE_MEMBERS unless
    given) and `max_bytes` in all, counted as the members are read. A refusal is a UserError naming `label`
    (default: the archive's file name) and, for a member that would leave `dest`, `into`."""
    caps = _Caps(label or archive.name, max_bytes, MAX_ARCHIVE_MEMBERS if max_members is None else max_members, into)
    dest.mkdir(parents=True, exist_ok=True)
    try:
        if zipfile.is_zipfile(archive):
            _extract_zip(archive, dest, caps)
        else:
            _extract_tar(archive, dest, caps)
    except tarfile.FilterError as e:  # tarfile's "data" filter, behind our own checks
        raise UserError(f"{caps.label}: refused: member {e.tarinfo.name!r} cannot be extracted safely") from None
    except (tarfile.TarError, zipfile.BadZipFile, EOFError) as e:
        raise UserError(f"{caps.label} is not a readable archive: {e}") from None


def _check_member(name: str, caps: _Caps) -> None:
    parts = Path(name).parts
    if name.startswith(("/", "\\")) or (parts and re.match(r"^[A-Za-z]:", parts[0])) or ".." in parts:
        raise UserError(f"{caps.label}: refused: member {name!r} would be written outside {caps.into}")


def _check_total(total: int, count: int, caps: _Caps) -> None:
    if count > caps.max_members:
        raise UserError(f"{caps.label}: refused: more than {caps.max_members} members")
    if total > caps.max_bytes:
        raise UserError(f"{caps.label}: refused: it would extract to more than {caps.max_bytes:,} bytes")


def _extract_tar(archive: Path, dest: Path, caps: _Caps) -> None:
    """One member at a time, as tarfile reads their headers: the caps refuse an archive at the first
    member past them, having read no more of it (a compressed tar is only read front to back)."""
    with _open_tar(archive, caps.label) as tar:
        total = 0
        for count, member in enumerate(tar, 1):
            _check_member(member.name, caps)
            if not (member.isfile() or member.isdir()):
                raise UserError(f"{caps.label}: refused: member {member.name!r} is a link or special file")
            total += member.size if member.isfile() else 0
            _check_total(total, count, caps)
            tar.extract(member, dest, filter="data")


def _open_tar(archive: Path, label: str) -> tarfile.TarFile:
    try:
        return tarfile.open(archive)  # reads the first member's header, no more
    except tarfile.ReadError:
        raise UserError(f"{label} is not a tar or zip archive") from None


def _extract_zip(archive: Path, dest: Path, caps: _Caps) -> None:
    _check_zip_directory(archive, caps)
    with zipfile.ZipFile(archive) as zf:
        infos = zf.infolist()
        for info in infos:
            _check_member(info.filename, caps)
            if stat.S_ISLNK(info.external_attr >> 16):
                raise UserError(f"{caps.label}: refused: member {info.filename!r} is a link")
        _check_total(sum(i.file_size for i in infos), len(infos), caps)
        written = 0
        for info in infos:  # file_size is what the archive claims: count what is really written
            target = dest / info.filename
            if info.is_dir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(info) as src, open(target, "wb") as out:
                while chunk := src.read(1 << 20):
                    written += len(chunk)
                    _check_total(written, 0, caps)
                    out.write(chunk)


def _check_zip_directory(archive: Path, caps: _Caps) -> None:
    """Refuse a zip whose end record declares more than the cap's members, or a central directory larger
    than MAX_ZIP_DIRECTORY_BYTES (or 256 bytes a member under a lower cap), before zipfile.ZipFile reads
    (and keeps) that whole directory. The record is read by zipfile's own helper, so these are the numbers
    ZipFile then goes by."""
    with open(archive, "rb") as f:
        record = zipfile._EndRecData(f)  # type: ignore[attr-defined]
    if record is None:
        return  # not a zip after all: ZipFile says so
    if record[zipfile._ECD_ENTRIES_TOTAL] > caps.max_members:  # type: ignore[attr-defined]
        raise UserError(f"{caps.label}: refused: more than {caps.max_members} members")
    limit = min(MAX_ZIP_DIRECTORY_BYTES, caps.max_members * 256)
    if (size := record[zipfile._ECD_SIZE]) > limit:  # type: ignore[attr-defined]
        raise UserError(f"{caps.label}: refused: its list of members takes {size:,} bytes, more than {limit:,}")


def _model_root(dest: Path, archive: str) -> Path:
    if (dest / "config.json").is_file():
        return dest
    found = sorted(p.parent for p in dest.glob("*/config.json"))
    if len(found) == 1:
        return found[0]
    raise UserError(f"{archive} holds no model directory (config.json at its top, or in one folder)")


# -- the Hugging Face Hub -------------------------------------------------------------------------


def fetch_hub(
    repo: str,
    dest: Path,
    *,
    revision: str | None = None,
    progress: Progress | None = None,
    memory_budget: int | None = None,
) -> Fetched:
    """Download what an import needs from Hub repo `repo` at `revision` (default: its main branch)
    through huggingface_hub's cache, and link it into `dest`; offline (HF_HUB_OFFLINE), the cache only.
    A model too big for `memory_budget` (or too big for any BERT) is refused before its weights download."""
    from huggingface_hub import constants

    if not is_hub_id(repo):
        raise UserError(f"{repo!r} is not a Hugging Face Hub repo id (owner/name)")
    if revision is not None and not valid_revision(revision):
        raise UserError(f"revision {revision!r} {REVISION_RULE}")
    try:
        if constants.is_offline_mode():
            snapshot, info = _cached_snapshot(repo, revision), None
        else:
            snapshot, info = _download(repo, revision, progress, memory_budget)
    except Exception as e:
        raise hub_error(e, repo, revision) from None
    for path in snapshot.rglob("*"):
        if path.is_file():
            (dest / path.relative_to(snapshot)).parent.mkdir(parents=True, exist_ok=True)
            os.symlink(path.resolve(), dest / path.relative_to(snapshot))
    _check_files(repo, sorted(str(p.relative_to(dest)) for p in dest.rglob("*")))
    license = card_license(info.card_data) if info is not None else None
    source = {"kind": "hub", "repo": repo, "revision": revision or "main", "sha": snapshot.name, "license": license}
    return Fetched(dest, source)


def _download(
    repo: str, revision: str | None, progress: Progress | None, memory_budget: int | None
) -> tuple[Path, Any]:
    """The repo's file list (one request), then only the files an import needs: the snapshot folder."""
    from huggingface_hub import HfApi, hf_hub_download

    info = HfApi().model_info(repo, revision=revision, files_metadata=True)
    sizes = {s.rfilename: s.size or 0 for s in info.siblings or []}
    names = [f for f in HUB_FILES if f in sizes]
    _check_files(repo, list(sizes))
    names.append(next(w for w in WEIGHTS if w in sizes))
    bar = progress_class(sum(sizes[n] for n in names), progress)
    config = Path(hf_hub_download(repo, "config.json", revision=revision, tqdm_class=bar))
    # before the weights: a GPT, or a BERT too big for this service, is refused at once
    _check_config(repo, config, names[-1], sizes[names[-1]], memory_budget)
    for name in names[1:-1]:
        hf_hub_download(repo, name, revision=revision, tqdm_class=bar)
    _check_modules(repo, config.parent)  # before the weights too: a Dense or a custom module is refused at once
    hf_hub_download(repo, names[-1], revision=revision, tqdm_class=bar)
    return config.parent, info  # the snapshot folder of the commit `revision` resolved to


def _cached_snapshot(repo: str, revision: str | None) -> Path:
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(repo, revision=revision, local_files_only=True))


def _check_files(repo: str, files: list[str]) -> None:
    """Refuse a file list without config.json or a single weights file, saying what it has."""
    if "config.json" not in files:
        raise UserError(f"{repo} has no config.json: not a Hugging Face model repo")
    if any(w in files for w in WEIGHTS):
        return
    if any(s in files for s in SHARDED):
        raise UserError(
            f"{repo} has its weights in shards ({', '.join(s for s in SHARDED if s in files)}): not supported"
        )
    raise UserError(f"{repo} has no weights file ({' or '.join(WEIGHTS)}); it has: {', '.join(sorted(files)[:20])}")


def _check_config(repo: str, path: Path, weights: str, weights_size: int, memory_budget: int | None) -> None:
    """What a repo's config.json and its weights file's listed size say before the weights download: a
    BERT (model_type), within model.config's bounds and `memory_budget` (model.model_dir.check_config),
    with weights of a size that fits it."""
    import json

    from model.config import MAX_CONFIG_BYTES, BertConfig
    from model.model_dir import check_config, check_weights_size

    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise UserError(f"{repo}: config.json is larger than the {MAX_CONFIG_BYTES:,} bytes a config may be")
    try:
        data = json.loads(path.read_bytes())
    except ValueError as e:
        raise UserError(f"{repo}: config.json is not valid JSON: {e}") from None
    model_type = data.get("model_type") if isinstance(data, dict) else None
    if model_type not in MODEL_TYPES:
        raise UserError(f"{repo} is not a BERT model: its config.json says model_type {model_type!r}")
    try:
        config = check_config(BertConfig.from_dict(data), memory_budget)
        if weights_size:  # the Hub lists every file's size
            check_weights_size(weights, weights_size, config)
    except ValueError as e:
        raise UserError(f"{repo}: {e}") from None


def _check_modules(repo: str, snapshot: Path) -> None:
    """The repo's sentence-transformers modules are ones this project runs (model.sentence_modules), or a
    PyLate ColBERT's (model.late_interaction)."""
    from model.late_interaction import late_interaction_layout, read_late_interaction
    from model.sentence_modules import read_sentence_modules

    try:
        if late_interaction_layout(snapshot) == "pylate":
            read_late_interaction(snapshot)
        else:
            read_sentence_modules(snapshot)
    except ValueError as e:
        raise UserError(f"{repo}: {e}") from None


def card_license(card_data: Any) -> str | None:
    if card_data is None:
        return None
    value = card_data.get("license") if hasattr(card_data, "get") else None
    return value if isinstance(value, str) else None


def progress_class(total: int, progress: Progress | None) -> Any:
    """huggingface_hub's tqdm (its bar, or none when HF_HUB_DISABLE_PROGRESS_BARS) that also reports
    the bytes of all files together to `progress`."""
    from huggingface_hub.utils import tqdm

    done = 0

    class Bar(tqdm):
        def update(self, n: float | None = 1) -> bool | None:
            nonlocal done
            done += int(n or 0)
            if progress is not None:
                progress(done, total)
            return super().update(n)

    return Bar


def hub_error(
    e: Exception, repo: str, revision: str | None, repo_type: str = "model", *, instead: bool = True
) -> Exception:
    """A Hub failure as the one-line UserError a user can act on (`repo_type`: "model" or "dataset"); anything
    unexpected unchanged. A Hub out of reach (or, offline, a cache without the repo) also says where else the
    import may come from (`instead`)."""
    from huggingface_hub import constants, errors

    at = f" at revision {revision!r}" if revision else ""
    if isinstance(e, UserError):
        return e
    if isinstance(e, errors.GatedRepoError):
        return UserError(
            f"{repo} is a gated repo: accept its terms on the Hub, then set HF_TOKEN to a token with access"
        )
    if isinstance(e, errors.RevisionNotFoundError):
        return UserError(f"{repo} has no revision {revision!r} on {constants.ENDPOINT}")
    if isinstance(e, errors.RepositoryNotFoundError):
        return UserError(
            f"no {repo_type} repo {repo} on {constants.ENDPOINT} (a private repo needs HF_TOKEN set to a token with "
            "access)"
        )
    if isinstance(e, errors.OfflineModeIsEnabled) or (
        isinstance(e, errors.LocalEntryNotFoundError) and constants.is_offline_mode()
    ):
        fix = f"; {hub_instead(repo_type, offline=True)}" if instead else ""
        return UserError(f"HF_HUB_OFFLINE is set and {repo}{at} is not in the Hugging Face cache (HF_HOME){fix}")
    if isinstance(e, errors.LocalEntryNotFoundError):  # online: the Hub did not answer, and the cache lacks it
        e = e.__cause__ if isinstance(e.__cause__, Exception) else e
    if isinstance(e, errors.HfHubHTTPError):
        return UserError(f"the Hub refused {repo}{at}: {str(e).splitlines()[0]}")
    if isinstance(e, OSError) and e.filename is not None:  # this machine's disk, not the network
        return UserError(f"cannot keep {repo}{at} in the Hugging Face cache (HF_HOME): {e.strerror}")
    if type(e).__module__.split(".")[0] in ("httpx", "httpx2", "httpcore") or isinstance(e, OSError):
        fix = f"; {hub_instead(repo_type, offline=False)}" if instead else ""
        return UserError(f"cannot reach the Hub at {constants.ENDPOINT} for {repo}: {type(e).__name__}: {e}{fix}")
    return e


def hub_instead(repo_type: str, offline: bool) -> str:
    """Where else an import of a `repo_type` ("model" or "dataset") may come from than a Hub it cannot have it from,
    and how to have the Hub (`offline`: HF_HUB_OFFLINE is set)."""
    if repo_type == "model":
        other = (
            f"import a local directory or an archive ({', '.join(ARCHIVE_SUFFIXES)}) of the model instead "
            "(bert import PATH, or the archive sent to POST /models)"
        )
    else:
        other = "upload the data file instead (bert datasets upload FILE, or the file sent to POST /datasets)"
    hub = "unset HF_HUB_OFFLINE to download it" if offline else "set HF_ENDPOINT to a Hub mirror this machine can reach"
    return f"{other}, or {hub}"


def hub_unreachable(repo: str, timeout: float = 3.0) -> str | None:
    """Why `repo` cannot be imported from the Hub now (offline, no answer within `timeout` seconds, no
    such repo), or None when the Hub answered for it."""
    from huggingface_hub import HfApi, constants

    if constants.is_offline_mode():
        return "HF_HUB_OFFLINE is set"
    if not is_hub_id(repo):
        return f"{repo!r} is not a Hub repo id"
    try:
        HfApi().model_info(repo, timeout=timeout)
    except Exception as e:
        error = hub_error(e, repo, None, instead=False)  # a reason the start logs: it falls back by itself
        return str(error) if isinstance(error, UserError) else f"{type(e).__name__}: {e}"
    return None


def hub_model_name(repo: str) -> str:
    """The model name a Hub repo gets in DATA_DIR/models by default: its name without the owner."""
    from datadir.layout import NAME_CHARACTERS, NAME_MAX_LENGTH, valid_name

    name, prefix = repo.rsplit("/", 1)[-1], "hub-"
    if valid_name(name):
        return name
    return prefix + re.sub(f"[^{NAME_CHARACTERS}]", "-", name)[: NAME_MAX_LENGTH - len(prefix)]
