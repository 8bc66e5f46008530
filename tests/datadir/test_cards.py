import json

from datadir.cards import CARD, read_card, update_card


def test_update_card_merges_keys_and_rewrites_whole(tmp_path):
    assert read_card(tmp_path) == {}
    update_card(tmp_path, source={"kind": "directory", "path": "x"})
    card = update_card(tmp_path, evaluation={"mlm_top1": 0.5})
    assert card == {"source": {"kind": "directory", "path": "x"}, "evaluation": {"mlm_top1": 0.5}}
    assert json.loads((tmp_path / CARD).read_text()) == card
    assert not [p for p in tmp_path.iterdir() if p.name != CARD]  # no temp file left behind


def test_unreadable_card_reads_as_empty(tmp_path):
    (tmp_path / CARD).write_text("[1, 2")
    assert read_card(tmp_path) == {}
    (tmp_path / CARD).write_text("[1, 2]")
    assert read_card(tmp_path) == {}
