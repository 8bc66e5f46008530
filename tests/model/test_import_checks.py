"""model/config.py's bounds: every size of a BertConfig, and its label count, checked before anything is
built from it (or, for labels, before one is made up), with a message that names the value and the bound."""

from __future__ import annotations

from pathlib import Path

import pytest

from model.config import MAX_CONFIG_BYTES, MAX_LABELS, SIZE_BOUNDS, BertConfig

# -- the config's bounds ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", [n for n in SIZE_BOUNDS if n != "num_labels"])
def test_each_size_is_bounded(name):
    most, why = SIZE_BOUNDS[name]
    sizes = {name: most + 1}
    if name == "hidden_size":
        sizes["num_attention_heads"] = 1  # still a multiple of the heads
    with pytest.raises(ValueError) as e:
        BertConfig(**sizes)
    assert str(e.value) == f"{name} is {most + 1:,}, more than the {most:,} a model may have ({why})"


def test_the_largest_config_is_a_config():
    config = BertConfig(**{n: most for n, (most, _) in SIZE_BOUNDS.items() if n != "num_labels"})
    assert config.num_hidden_layers == 48 and config.vocab_size == 524_288


@pytest.mark.parametrize(
    "data, message",
    [
        ({"num_labels": 3_000_000}, "num_labels is 3,000,000, more than the 10,000 a model may have"),
        (
            {"id2label": {str(i): "x" for i in range(MAX_LABELS + 1)}},
            "id2label has 10,001 labels, more than the 10,000",
        ),
        ({"label2id": {str(i): i for i in range(MAX_LABELS + 1)}}, "label2id has 10,001 labels, more than the 10,000"),
        ({"id2label": ["a", "b"]}, "id2label must be a JSON object, got list"),
    ],
)
def test_labels_are_bounded_before_they_are_made(data, message):
    with pytest.raises(ValueError) as e:
        BertConfig.from_dict(data)
    assert message in str(e.value)


def test_at_the_label_bound_a_config_loads():
    assert BertConfig.from_dict({"num_labels": MAX_LABELS}).num_labels == MAX_LABELS


def test_a_huge_config_file_is_not_read(tmp_path, monkeypatch):
    path = tmp_path / "config.json"
    with open(path, "wb") as f:
        f.truncate(MAX_CONFIG_BYTES + 1)  # sparse: nothing is written
    monkeypatch.setattr(Path, "read_text", lambda *a, **k: pytest.fail("read a config past the bound"))
    with pytest.raises(ValueError, match=f"is {MAX_CONFIG_BYTES + 1:,} bytes, more than the {MAX_CONFIG_BYTES:,}"):
        BertConfig.from_json_file(path)
