"""model/sources.py: importing from a directory, an archive, and the Hub (a real huggingface_hub client
against tests/hub_server.py's fake Hub)."""

from __future__ import annotations

import io
import tarfile
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from datadir.cards import read_card
from model.errors import UserError
from model.sources import extract_archive, import_source, source_kind
from tests import hub_server as H

# where else a model may come from, when the Hub cannot give it
MODEL_INSTEAD = (
    "import a local directory or an archive (.tar, .tar.gz, .tgz, .zip) of the model instead (bert import PATH, or "
    "the archive sent to POST /models)"
)


def same_tensors(a: Path, b: Path) -> bool:
    x, y = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


@pytest.fixture
def tiny_dir(tmp_path) -> Path:
    return H.tiny_model_dir(tmp_path, 0)


def test_hub_import_equals_directory_import(hub, hub_env, tmp_path, tiny_dir):
    seen, start = [], len(hub.requests)
    version, summary = import_source(tmp_path / "data", H.TINY_REPO, "tiny", progress=lambda d, t: seen.append((d, t)))
    local, _ = import_source(tmp_path / "data", str(tiny_dir), "local")
    assert same_tensors(version, local)
    assert summary["architecture"] == "BertForPreTraining"
    card = read_card(version)["source"]
    sha = hub.repos[H.TINY_REPO].refs["main"]
    assert card == {"kind": "hub", "repo": H.TINY_REPO, "revision": "main", "sha": sha, "license": "apache-2.0"}
    assert read_card(local)["source"] == {"kind": "directory", "path": str(tiny_dir.resolve())}
    # measured on the held-out set before it was published: the same weights, the same scores
    from model.model_card import evaluate_card

    assert read_card(version)["evaluation"] == read_card(local)["evaluation"] == evaluate_card(local)
    assert read_card(version)["evaluation"]["set"] == "wiki-heldout-v1"
    # and each precision this CPU runs natively, against fp32 (what auto chooses from)
    from model.precision_choice import cpu_kind, native_precisions

    row = read_card(version)["precision"][cpu_kind()]
    assert row["outputs"] == ["embeddings", "fill_mask", "nsp"] and sorted(row["precisions"]) == sorted(
        native_precisions()
    )
    assert seen and seen[-1][0] == seen[-1][1] > 0  # every byte of what was fetched, counted
    got = [p for m, p in hub.requests[start:] if m == "GET"]
    text = ("config.json", "tokenizer.json", "tokenizer_config.json", "vocab.txt")
    assert sorted(p for p in got if "/resolve/" in p) == [f"/{H.TINY_REPO}/resolve/main/{f}" for f in text]
    assert len([p for p in got if p.startswith("/cdn/")]) == 1  # one weights file, from the "CDN"
    assert not list((tmp_path / "data").glob(".tmp-*"))


def test_hub_revision_is_other_weights(hub, hub_env, tmp_path):
    main, _ = import_source(tmp_path / "data", H.TINY_REPO, "a")
    v2, _ = import_source(tmp_path / "data", H.TINY_REPO, "b", revision="v2")
    assert not same_tensors(main, v2)
    assert same_tensors(v2, H.tiny_model_dir(tmp_path, 1))
    assert read_card(v2)["source"]["sha"] == hub.repos[H.TINY_REPO].refs["v2"]
    assert read_card(v2)["source"]["revision"] == "v2"


def test_bin_only_repo_reads_weights_only(hub, hub_env, tmp_path, tiny_dir):
    version, _ = import_source(tmp_path / "data", H.BIN_REPO, "bin")
    assert same_tensors(version, tiny_dir)
    assert read_card(version)["source"]["license"] == "mit"


@pytest.mark.parametrize(
    "repo, revision, message",
    [
        (
            H.PICKLED_REPO,
            None,
            f"{H.PICKLED_REPO}: pytorch_model.bin is not plain weights: loading it would unpickle code",
        ),
        (H.GATED_REPO, None, f"{H.GATED_REPO} is a gated repo: accept its terms on the Hub, then set HF_TOKEN"),
        ("acme/missing", None, "no model repo acme/missing on http://127.0.0.1:"),
        (H.TINY_REPO, "v9", f"{H.TINY_REPO} has no revision 'v9' on http://127.0.0.1:"),
        (H.NOT_BERT_REPO, None, f"{H.NOT_BERT_REPO} is not a BERT model: its config.json says model_type 'gpt2'"),
        (H.NO_WEIGHTS_REPO, None, f"{H.NO_WEIGHTS_REPO} has no weights file (model.safetensors or pytorch_model.bin)"),
        (H.SHARDED_REPO, None, "has its weights in shards (model.safetensors.index.json): not supported"),
    ],
)
def test_hub_refusals(hub, hub_env, tmp_path, repo, revision, message):
    with pytest.raises(UserError) as e:
        import_source(tmp_path / "data", repo, "m", revision=revision)
    assert message in str(e.value)
    assert not (tmp_path / "data" / "models" / "m").exists()
    assert not list((tmp_path / "data").glob(".tmp-*"))


def test_gated_repo_with_token(hub, hub_env, tmp_path, monkeypatch, tiny_dir):
    monkeypatch.setenv("HF_TOKEN", H.TOKEN)
    version, _ = import_source(tmp_path / "data", H.GATED_REPO, "gated")
    assert same_tensors(version, tiny_dir)


def test_offline_uses_the_cache(hub, hub_env, tmp_path, monkeypatch):
    from huggingface_hub import constants

    first, _ = import_source(tmp_path / "data", H.TINY_REPO, "online")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    before = len(hub.requests)
    again, _ = import_source(tmp_path / "data", H.TINY_REPO, "offline")
    assert len(hub.requests) == before  # nothing asked of the Hub
    assert same_tensors(first, again)
    assert read_card(again)["source"]["sha"] == hub.repos[H.TINY_REPO].refs["main"]
    with pytest.raises(UserError) as e:
        import_source(tmp_path / "data", H.BIN_REPO, "bin")
    assert str(e.value) == (
        f"HF_HUB_OFFLINE is set and {H.BIN_REPO} is not in the Hugging Face cache (HF_HOME); {MODEL_INSTEAD}, or "
        "unset HF_HUB_OFFLINE to download it"
    )


def test_unreachable_hub(hub_env, tmp_path, monkeypatch):
    from huggingface_hub import constants

    from tests.helpers import free_port

    dead = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setattr(constants, "ENDPOINT", dead)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", dead + "/{repo_id}/resolve/{revision}/{filename}")
    with pytest.raises(UserError) as e:
        import_source(tmp_path / "data", H.TINY_REPO, "m")
    assert str(e.value) == (
        f"cannot reach the Hub at {dead} for {H.TINY_REPO}: ConnectError: [Errno 111] Connection refused; "
        f"{MODEL_INSTEAD}, or set HF_ENDPOINT to a Hub mirror this machine can reach"
    )


def _tar(members: dict[str, bytes], path: Path, link: str | None = None) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        if link:
            info = tarfile.TarInfo("evil")
            info.type, info.linkname = tarfile.SYMTYPE, link
            tar.addfile(info)
    return path


def test_archives_import_like_the_directory(tmp_path, tiny_dir):
    files = {f"tiny/{p.name}": p.read_bytes() for p in tiny_dir.iterdir()}
    tgz = _tar(files, tmp_path / "tiny.tar.gz")
    zipped = tmp_path / "tiny.zip"
    with zipfile.ZipFile(zipped, "w") as zf:
        for name, data in files.items():
            zf.writestr(name.removeprefix("tiny/"), data)
    for archive in (tgz, zipped):
        assert source_kind(str(archive)) == "archive"
        version, _ = import_source(tmp_path / "data", str(archive), archive.name.replace(".", "-"))
        assert same_tensors(version, tiny_dir)
        assert read_card(version)["source"] == {"kind": "archive", "file": archive.name}


@pytest.mark.parametrize(
    "members, link, message",
    [
        ({"../x/config.json": b"{}"}, None, "member '../x/config.json' would be written outside the model directory"),
        ({"/etc/config.json": b"{}"}, None, "member '/etc/config.json' would be written outside"),
        ({"config.json": b"{}"}, "/etc/passwd", "member 'evil' is a link or special file"),
        ({"config.json": b"x" * 2000}, None, "it would extract to more than 1,000 bytes"),
        ({"readme.md": b"hi"}, None, "holds no model directory"),
    ],
)
def test_archive_refusals(tmp_path, members, link, message):
    archive = _tar(members, tmp_path / "bad.tar.gz", link)
    with pytest.raises(UserError) as e:
        extract_archive(archive, tmp_path / "out", max_bytes=1000)
    assert message in str(e.value)


def test_zip_refuses_traversal(tmp_path):
    archive = tmp_path / "bad.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("../evil.json", b"{}")
    with pytest.raises(UserError, match="would be written outside"):
        extract_archive(archive, tmp_path / "out")
    assert not (tmp_path / "evil.json").exists()


def test_source_kind(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    assert source_kind(str(tmp_path)) == "directory"
    assert source_kind("google-bert/bert-base-uncased") == "hub"
    with pytest.raises(UserError, match="is a file but not an archive"):
        source_kind(str(tmp_path / "notes.txt"))
    with pytest.raises(UserError, match="neither a directory, an archive nor a Hugging Face Hub repo id"):
        source_kind("./no/such/dir/here")


def many_members(path: Path, count: int) -> Path:
    """A tar.gz of `count` one-byte files."""
    with tarfile.open(path, "w:gz") as tar:
        for i in range(count):
            info = tarfile.TarInfo(f"m/{i}.txt")
            info.size = 1
            tar.addfile(info, io.BytesIO(b"x"))
    return path


def test_a_tar_past_the_member_cap_is_refused_at_the_first_member_past_it(tmp_path, monkeypatch):
    import model.sources as sources

    archive = many_members(tmp_path / "many.tar.gz", 2_000)
    monkeypatch.setattr(sources, "MAX_ARCHIVE_MEMBERS", 50)
    read = []
    headers = tarfile.TarInfo.fromtarfile.__func__

    def counted(cls, tar):
        member = headers(cls, tar)
        read.append(member.name)
        return member

    monkeypatch.setattr(tarfile.TarInfo, "fromtarfile", classmethod(counted))
    with pytest.raises(UserError) as e:
        extract_archive(archive, tmp_path / "out")
    assert str(e.value) == "many.tar.gz: refused: more than 50 members"
    assert len(read) == 51  # the archive's other 1,949 headers were never read
    assert len(list((tmp_path / "out" / "m").iterdir())) == 50


def test_a_zip_past_the_member_cap_is_refused_before_its_member_list_is_read(tmp_path, monkeypatch):
    import model.sources as sources

    archive = tmp_path / "many.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for i in range(200):
            zf.writestr(f"m/{i}.txt", b"x")
    monkeypatch.setattr(sources, "MAX_ARCHIVE_MEMBERS", 50)
    monkeypatch.setattr(zipfile, "ZipFile", lambda *a, **k: pytest.fail("read the member list"))
    with pytest.raises(UserError, match="^many.zip: refused: more than 50 members$"):
        extract_archive(archive, tmp_path / "out")
    monkeypatch.setattr(sources, "MAX_ARCHIVE_MEMBERS", 10_000)
    monkeypatch.setattr(sources, "MAX_ZIP_DIRECTORY_BYTES", 1_000)
    with pytest.raises(UserError) as e:
        extract_archive(archive, tmp_path / "out")
    assert str(e.value).startswith("many.zip: refused: its list of members takes ")
    assert str(e.value).endswith(" bytes, more than 1,000")
    assert not (tmp_path / "out" / "m").exists()


def test_a_tar_member_past_the_size_cap_is_refused_before_it_is_written(tmp_path):
    archive = _tar({"config.json": b"{}", "model.safetensors": b"x" * 5000}, tmp_path / "big.tar.gz")
    with pytest.raises(UserError, match="^big.tar.gz: refused: it would extract to more than 1,000 bytes$"):
        extract_archive(archive, tmp_path / "out", max_bytes=1000)
    assert (tmp_path / "out" / "config.json").is_file() and not (tmp_path / "out" / "model.safetensors").exists()


def test_a_member_after_dotdot_is_never_reached(tmp_path):
    archive = _tar({"ok.txt": b"a", "x/../../evil.txt": b"b", "late.txt": b"c"}, tmp_path / "bad.tar.gz")
    with pytest.raises(UserError, match="member 'x/../../evil.txt' would be written outside the model directory"):
        extract_archive(archive, tmp_path / "out")
    assert not (tmp_path / "evil.txt").exists() and not (tmp_path / "out" / "late.txt").exists()
