"""The /v1/files store (datadir/batch_files.py): a file appears whole, is listed newest first,
is added once per chosen id, and goes on delete or past its age."""

from __future__ import annotations

import json
import os

import pytest

from datadir.batch_files import CONTENT, RECORD, FileNotFound, Files, valid_file_id


def test_add_read_list_delete(tmp_path):
    files = Files(tmp_path)
    (tmp_path / "a").write_bytes(b'{"x": 1}\n')
    record = files.add(tmp_path / "a", "in.jsonl", "batch")
    assert valid_file_id(record["id"]) and not (tmp_path / "a").exists()
    assert files.read(record["id"]) == record == json.loads((files.file_dir(record["id"]) / RECORD).read_text())
    assert (record["bytes"], record["object"], record["filename"], record["purpose"]) == (
        9,
        "file",
        "in.jsonl",
        "batch",
    )
    assert files.content(record["id"]).read_bytes() == b'{"x": 1}\n'
    (tmp_path / "b").write_bytes(b"")
    out = files.add(tmp_path / "b", "out.jsonl", "batch_output", file_id="file-job-output")
    (tmp_path / "c").write_bytes(b"other")
    assert files.add(tmp_path / "c", "again", "batch_output", file_id="file-job-output") == out  # once per id
    assert {r["id"] for r in files.list()} == {record["id"], "file-job-output"}
    assert [r["id"] for r in files.list("batch_output")] == ["file-job-output"]
    files.delete(record["id"])
    for call in (files.read, files.content, files.delete):
        with pytest.raises(FileNotFound):
            call(record["id"])
    assert [p.name for p in files.root.iterdir()] == ["file-job-output"]  # no temp left behind


def test_ids_are_checked_and_old_files_expire(tmp_path):
    files = Files(tmp_path)
    for bad in ("../x", "file-", "file-a/b", "x" * 90, None):
        assert not valid_file_id(bad)
    with pytest.raises(FileNotFound):
        files.read("../../etc")
    (tmp_path / "a").write_bytes(b"1")
    old = files.add(tmp_path / "a", "old", "batch")
    record = json.loads((files.file_dir(old["id"]) / RECORD).read_text())
    (files.file_dir(old["id"]) / RECORD).write_text(json.dumps({**record, "created_at": record["created_at"] - 100}))
    (tmp_path / "b").write_bytes(b"2")
    new = files.add(tmp_path / "b", "new", "batch")
    assert files.expire(50) == [old["id"]]
    assert [r["id"] for r in files.list()] == [new["id"]] and os.path.isfile(files.file_dir(new["id"]) / CONTENT)
