"""datadir/versions.py and publish.py: versions of a model, the promoted one, a flat model's
migration into v1/, idempotent and concurrent publishing, deletion."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil

import pytest

from datadir import (
    PROVENANCE,
    ModelNotFound,
    PromotedVersion,
    VersionNotFound,
    delete_dataset,
    delete_model,
    delete_version,
    list_versions,
    model_dir_for,
    promote,
    publish_model,
)
from datadir import publish as publish_module
from datadir.versions import served_dir


def _model(path, weights: bytes = b"w" * 100):
    """A finished model directory as a job leaves it (content is all the registry looks at here)."""
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(weights)
    return path


def _promoted(data_dir, name):
    """model.json's promoted version, as {"promoted": N} (its owner and sharing: test_a_name_belongs_...)."""
    return {"promoted": json.loads((data_dir / "models" / name / "model.json").read_text())["promoted"]}


def test_publishing_makes_the_next_version_and_promotes_it(tmp_path):
    data = tmp_path / "data"
    first = publish_model(data, "job-1", _model(tmp_path / "out1"), "m")
    assert first == data / "models" / "m" / "v1" and not (tmp_path / "out1").exists()
    assert _promoted(data, "m") == {"promoted": 1}
    assert json.loads((first / PROVENANCE).read_text())["job_id"] == "job-1"
    second = publish_model(data, "job-2", _model(tmp_path / "out2", b"x" * 300), "m")
    assert second == data / "models" / "m" / "v2" and model_dir_for(data, "m") == second
    assert _promoted(data, "m") == {"promoted": 2}
    listed = list_versions(data, "m")
    assert [(v.version, v.promoted, v.made_by, v.path) for v in listed] == [
        (1, False, "job-1", first),
        (2, True, "job-2", second),
    ]
    assert listed[1].disk_bytes == sum(f.stat().st_size for f in second.iterdir())
    assert all(v.created_at and v.created_at.endswith("Z") for v in listed)
    assert not [p for p in (data / "models").iterdir() if p.name.startswith(".tmp")]


def test_a_retried_publish_finds_its_own_version_and_makes_no_other(tmp_path):
    data = tmp_path / "data"
    publish_model(data, "job-1", _model(tmp_path / "out1"), "m")
    mine = publish_model(data, "job-2", _model(tmp_path / "out2"), "m")
    promote(data, "m", 1)
    # The worker died after the rename, before recording success: the retry finds v2 (and promotes it).
    (tmp_path / "out2").mkdir()
    assert publish_model(data, "job-2", tmp_path / "out2", "m") == mine
    assert not (tmp_path / "out2").exists() and [v.version for v in list_versions(data, "m")] == [1, 2]
    assert _promoted(data, "m") == {"promoted": 2}


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two-renames"])
def test_a_flat_model_is_migrated_into_v1_by_hard_links(tmp_path, monkeypatch, exchange):
    data = tmp_path / "data"
    flat = _model(data / "models" / "m")
    inode = (flat / "model.safetensors").stat().st_ino
    assert model_dir_for(data, "m") == flat
    assert [(v.version, v.promoted, v.path) for v in list_versions(data, "m")] == [(1, True, flat)]
    if not exchange:  # where renameat2 is missing: two renames
        monkeypatch.setattr(publish_module, "_exchange", lambda a, b: False)
    second = publish_model(data, "job-2", _model(tmp_path / "out"), "m")
    root = data / "models" / "m"
    assert sorted(p.name for p in root.iterdir()) == ["model.json", "v1", "v2"]
    assert (root / "v1" / "model.safetensors").stat().st_ino == inode  # linked, not copied
    assert (root / "v1" / "model.safetensors").stat().st_nlink == 1  # the flat directory is gone
    assert second == root / "v2" and _promoted(data, "m") == {"promoted": 2}
    assert sorted(p.name for p in (data / "models").iterdir()) == [".m.lock", "m"]


def test_a_flat_model_a_job_published_is_found_by_its_retry(tmp_path):
    data = tmp_path / "data"
    flat = _model(data / "models" / "m")
    (flat / PROVENANCE).write_text(json.dumps({"job_id": "job-1"}))
    (tmp_path / "out").mkdir()
    assert publish_model(data, "job-1", tmp_path / "out", "m") == flat
    assert not (flat / "model.json").exists() and not (tmp_path / "out").exists()


def _publish(data_dir, out, job_id):
    publish_model(data_dir, job_id, out, "m")


def test_concurrent_publishers_never_take_one_number(tmp_path):
    data = tmp_path / "data"
    ctx = multiprocessing.get_context("fork")
    outs = [_model(tmp_path / f"out{i}") for i in range(6)]
    procs = [ctx.Process(target=_publish, args=(data, out, f"job-{i}")) for i, out in enumerate(outs)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    assert [p.exitcode for p in procs] == [0] * 6
    versions = list_versions(data, "m")
    assert [v.version for v in versions] == [1, 2, 3, 4, 5, 6]
    assert sorted(v.made_by for v in versions) == [f"job-{i}" for i in range(6)]


def test_promote_switches_and_names_the_versions_there_are(tmp_path):
    data = tmp_path / "data"
    publish_model(data, "job-1", _model(tmp_path / "out1"), "m")
    publish_model(data, "job-2", _model(tmp_path / "out2"), "m")
    inode = (data / "models" / "m" / "model.json").stat().st_ino
    promote(data, "m", 1)
    assert model_dir_for(data, "m") == data / "models" / "m" / "v1"
    assert (data / "models" / "m" / "model.json").stat().st_ino != inode  # replaced whole, not edited
    with pytest.raises(VersionNotFound, match=r"^model 'm' has no version 7 \(versions: 1, 2\)$"):
        promote(data, "m", 7)
    with pytest.raises(ModelNotFound, match="^model 'ghost' not found$"):
        promote(data, "ghost", 1)
    flat = _model(data / "models" / "flat")
    promote(data, "flat", 1)  # a flat model's only version: nothing to write
    assert not (flat / "model.json").exists()


def test_deletion_rules_and_what_it_frees(tmp_path):
    data = tmp_path / "data"
    for i in (1, 2, 3):
        publish_model(data, f"job-{i}", _model(tmp_path / f"out{i}", b"w" * 100 * i), "m")
    with pytest.raises(PromotedVersion, match=r"version 3 of model 'm' is the promoted one; promote another \(1, 2\)"):
        delete_version(data, "m", 3)
    v1 = data / "models" / "m" / "v1"
    size = sum(f.stat().st_size for f in v1.iterdir())
    assert delete_version(data, "m", 1) == size
    assert [v.version for v in list_versions(data, "m")] == [2, 3] and not v1.exists()
    with pytest.raises(VersionNotFound, match=r"versions: 2, 3"):
        delete_version(data, "m", 1)
    promote(data, "m", 2)
    delete_version(data, "m", 3)
    assert delete_version(data, "m", 2) > 200  # the last version: the model goes with it
    assert model_dir_for(data, "m") is None and list_versions(data, "m") == []
    assert not (data / "models" / "m").exists()
    with pytest.raises(ModelNotFound):
        delete_model(data, "m")
    flat = _model(data / "models" / "flat")
    assert delete_model(data, "flat") == 102 and not flat.exists()
    assert [p.name for p in (data / "models").iterdir() if not p.name.endswith(".lock")] == []


def test_deleting_a_dataset_frees_its_directory(tmp_path):
    data = tmp_path / "data"
    ds = data / "datasets" / "d"
    (ds / "cache").mkdir(parents=True)
    (ds / "meta.json").write_text(json.dumps({"name": "d", "file": "data.txt"}))
    (ds / "data.txt").write_text("hello\n")
    (ds / "cache" / "tokens.bin").write_bytes(b"t" * 50)
    expected = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(ds) for f in fs)
    assert delete_dataset(data, "d") == expected and not ds.exists()
    with pytest.raises(FileNotFoundError, match="dataset 'd' not found"):
        delete_dataset(data, "d")


def test_a_command_given_a_models_folder_reads_its_promoted_version(tmp_path):
    from app.cli.model_commands import model_dir_arg

    data = tmp_path / "data"
    first = publish_model(data, "job-1", _model(tmp_path / "out1"), "m")
    publish_model(data, "job-2", _model(tmp_path / "out2"), "m")
    promote(data, "m", 1)
    assert served_dir(data / "models" / "m") == first
    assert model_dir_arg(str(data / "models" / "m")) == str(first)
    flat = _model(tmp_path / "flat")  # a plain directory, a run directory, a missing path: as given
    assert served_dir(flat) == flat and served_dir(tmp_path / "none") == tmp_path / "none"
    assert served_dir(tmp_path) == tmp_path


def test_a_version_records_the_key_that_made_its_job(tmp_path):
    from datadir import JobRecords

    data = tmp_path / "data"
    store = JobRecords(data)
    owned = store.create({"kind": "finetune", "model_name": "m", "params": {}, "owner": "alice"})
    older = store.create({"kind": "finetune", "model_name": "m", "params": {}})  # from before keys had names
    first = publish_model(data, owned["id"], _model(tmp_path / "out1"), "m")
    # the version keeps its owner when the job is gone:
    shutil.rmtree(store.job_dir(owned["id"]))
    publish_model(data, older["id"], _model(tmp_path / "out2"), "m")
    publish_model(data, "no-such-job", _model(tmp_path / "out3"), "m")
    assert json.loads((first / PROVENANCE).read_text())["owner"] == "alice"
    assert [(v.version, v.owner) for v in list_versions(data, "m")] == [(1, "alice"), (2, "admin"), (3, "admin")]
    (data / "models" / "m" / "v3" / PROVENANCE).unlink()  # made some other way
    assert list_versions(data, "m")[2].owner is None


def test_a_name_belongs_to_the_key_that_first_published_it(tmp_path):
    from datadir import JobRecords
    from datadir.publish import OWNER_RULE, NotOwner, set_shared
    from datadir.versions import Access, access_of

    data = tmp_path / "data"
    records = JobRecords(data)

    def job(owner: str, admin: bool = False, name: str = "m") -> str:
        spec = {"kind": "finetune", "model_name": name, "params": {}, "owner": owner, "publish_any": admin}
        return records.create(spec)["id"]

    publish_model(data, job("alice"), _model(tmp_path / "a1"), "m")
    assert access_of(data, "m") == Access("alice", shared=False)
    publish_model(data, job("alice"), _model(tmp_path / "a2"), "m")  # her next version
    with pytest.raises(NotOwner) as refused:
        publish_model(data, job("bob"), _model(tmp_path / "b1"), "m")
    assert str(refused.value) == f"model 'm' belongs to another key: {OWNER_RULE}"
    assert (tmp_path / "b1" / "config.json").is_file()  # the trained model stays where it was
    assert [v.version for v in list_versions(data, "m")] == [1, 2]
    publish_model(data, job("boss", admin=True), _model(tmp_path / "c1"), "m")  # an admin's job: any name
    older = records.create({"kind": "finetune", "model_name": "m", "params": {}, "owner": "bob"})  # before owners
    publish_model(data, older["id"], _model(tmp_path / "d1"), "m")
    assert [v.version for v in list_versions(data, "m")] == [1, 2, 3, 4]
    assert access_of(data, "m") == Access("alice", shared=False)  # publishing and promoting keep the access
    promote(data, "m", 1)
    assert access_of(data, "m") == Access("alice", shared=False)

    publish_model(data, job("boss", admin=True, name="n"), _model(tmp_path / "n1"), "n")
    assert access_of(data, "n") == Access("boss", shared=True)  # an admin's new model is shared from the start
    assert set_shared(data, "n", False) == Access("boss", shared=False) == access_of(data, "n")
    with pytest.raises(ModelNotFound):
        set_shared(data, "nothing", True)


def test_what_model_json_does_not_say_is_admins_and_shared(tmp_path):
    from datadir.publish import set_shared
    from datadir.versions import Access, access_of

    data = tmp_path / "data"
    _model(data / "models" / "flat")  # a legacy flat model
    assert access_of(data, "flat") == Access("admin", shared=True)
    _model(data / "models" / "old" / "v1")
    (data / "models" / "old" / "model.json").write_text('{"promoted": 1}')  # from before owners
    assert access_of(data, "old") == Access("admin", shared=True)
    assert access_of(data, "none") is None
    assert set_shared(data, "flat", False) == Access("admin", shared=False)  # a flat model moves into v1/ first
    assert (data / "models" / "flat" / "v1" / "config.json").is_file() and access_of(data, "flat").shared is False
