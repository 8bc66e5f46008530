"""atomic_dir: a replaced directory is never missing, never half-written, and leaves no temp dirs."""

from __future__ import annotations

import threading

from datadir.files import atomic_dir
from model.weights import state_dict_keys


def test_replacing_a_directory_never_leaves_it_missing(tmp_path):
    dst = tmp_path / "model"
    with atomic_dir(dst) as tmp:
        (tmp / "version").write_text("0")
    seen_missing, stop = [], threading.Event()

    def reader():
        while not stop.is_set():
            try:
                (dst / "version").read_text()
            except FileNotFoundError:
                seen_missing.append(1)

    thread = threading.Thread(target=reader)
    thread.start()
    for i in range(1, 200):
        with atomic_dir(dst) as tmp:
            (tmp / "version").write_text(str(i))
    stop.set()
    thread.join()
    assert not seen_missing
    assert (dst / "version").read_text() == "199"
    assert [p.name for p in tmp_path.iterdir()] == ["model"], "no temp or old directories left behind"


def test_state_dict_keys_reads_the_header(tmp_path, tiny_config):
    from model.modeling import BertForMaskedLM

    model = BertForMaskedLM(tiny_config)
    model.save_pretrained(tmp_path)
    assert sorted(state_dict_keys(tmp_path)) == sorted(model.state_dict())
