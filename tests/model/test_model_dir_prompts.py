"""model.model_dir.read_prompts reads a sentence-transformers model's prompts as sentence-transformers does,
refuses a file that contradicts itself, and import_model keeps them."""

from __future__ import annotations

import json

import pytest

from model.model_dir import SENTENCE_TRANSFORMERS_CONFIG, import_model, read_prompts
from model.modeling import BertModel
from tests.app.conftest import save_tiny


def write(path, config) -> None:
    (path / SENTENCE_TRANSFORMERS_CONFIG).write_text(json.dumps(config))


def test_prompts_default_and_none(tmp_path):
    assert read_prompts(tmp_path) == ({}, None)
    write(tmp_path, {"__version__": {"sentence_transformers": "2.0.0"}})  # all-MiniLM-L6-v2's: no prompts
    assert read_prompts(tmp_path) == ({}, None)
    write(tmp_path, {"prompts": {"query": "query: ", "passage": "passage: "}, "default_prompt_name": "query"})
    assert read_prompts(tmp_path) == ({"query": "query: ", "passage": "passage: "}, "query")


def test_a_default_that_is_not_a_prompt_is_refused(tmp_path):
    write(tmp_path, {"prompts": {"query": "query: "}, "default_prompt_name": "passage"})
    with pytest.raises(ValueError) as e:
        read_prompts(tmp_path)
    assert str(e.value) == (
        "config_sentence_transformers.json: default_prompt_name 'passage' is not one of its prompts (query)"
    )
    write(tmp_path, {"prompts": {"query": 1}})
    with pytest.raises(ValueError, match=r"prompts must map names to texts, got \{'query': 1\}"):
        read_prompts(tmp_path)


def test_import_keeps_the_prompts(tmp_path):
    save_tiny(tmp_path / "src", BertModel)
    write(tmp_path / "src", {"prompts": {"query": "the "}, "default_prompt_name": None})
    import_model(tmp_path / "src", tmp_path / "dst")
    assert read_prompts(tmp_path / "dst") == ({"query": "the "}, None)
    save_tiny(tmp_path / "plain", BertModel)
    import_model(tmp_path / "plain", tmp_path / "plain-dst")
    assert not (tmp_path / "plain-dst" / SENTENCE_TRANSFORMERS_CONFIG).exists()
