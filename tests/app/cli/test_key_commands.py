"""`bert keys add` (app/cli/key_commands.py) through the command's own main(): the file's first key warns on
stderr that the service now needs a key on every route, and names the command that makes its owner an admin
key; that command works as printed; later keys add no warning. The rest of `bert keys` (list, revoke, rotate,
the audit log, a server taking the changes) is tests/app/test_keys_server.py."""

from __future__ import annotations

import shlex

import pytest

from app.cli import main
from app.keys.keyfile import hash_secret, read_keys


@pytest.fixture(autouse=True)
def no_keys_settings(monkeypatch):
    for name in ("BERT_KEYS_FILE", "BERT_DATA_DIR"):
        monkeypatch.delenv(name, raising=False)


def warning_for(name: str, path) -> str:
    return (
        f"bert keys: warning: '{name}' is the first key in {path}: a service that reads this file (BERT_KEYS_FILE, "
        "by default DATA_DIR/keys.toml) now needs a key on every route but /health and /ready, within a second and "
        "without a restart; a request without one gets 401"
    )


def test_the_first_key_warns_and_names_the_command_for_an_admin_key(tmp_path, capsys):
    keys_file, data_dir = tmp_path / "my keys.toml", tmp_path / "data"
    where = ["--file", str(keys_file), "--data-dir", str(data_dir)]
    assert main(["keys", "add", "alice", "--scope", "inference", *where]) == 0
    out, err = capsys.readouterr()
    *text, secret = out.splitlines()
    assert text == [
        f"added key 'alice' to {keys_file}: scopes inference; no limits",
        "its secret, shown only this once (send it as 'Authorization: Bearer <secret>'):",
    ]
    assert read_keys(keys_file)["alice"].hash == hash_secret(secret)
    command = (
        "bert keys add owner --scope admin --scope inference --scope metrics "
        f"--file '{keys_file}' --data-dir {data_dir}"
    )
    assert err == (
        f"{warning_for('alice', keys_file)}\n"
        "bert keys: 'alice' lacks the scope admin, so it opens no /jobs, /datasets or model management; make "
        f"yourself a key that does: {command}\n"
    )

    assert main(shlex.split(command)[1:]) == 0  # the command as printed
    out, err = capsys.readouterr()
    assert err == "" and out.startswith(f"added key 'owner' to {keys_file}: scopes inference, admin, metrics;")
    assert read_keys(keys_file)["owner"].is_admin


def test_a_first_key_with_the_scope_admin_only_warns(tmp_path, capsys):
    data_dir = tmp_path / "data"
    assert main(["keys", "add", "root", "--scope", "admin", "--scope", "inference", "--data-dir", str(data_dir)]) == 0
    assert capsys.readouterr().err == warning_for("root", data_dir / "keys.toml") + "\n"


def test_a_first_key_named_owner_gets_another_name_for_the_admin_key(tmp_path, capsys):
    assert main(["keys", "add", "owner", "--data-dir", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert err.endswith(
        f": bert keys add owner-admin --scope admin --scope inference --scope metrics --data-dir {tmp_path}\n"
    )
    assert main(["keys", "add", "owner-admin", "--scope", "admin", "--data-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().err == ""  # not the first any more
