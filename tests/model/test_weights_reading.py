"""Reading weights: model/weights.py's own safetensors reader against the library's, and a load that
builds the model around the file's tensors (model/modeling.py's _from_state) against one that copies them."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from model.config import BertConfig
from model.modeling import BertForPreTraining, load_model
from model.weights import read_safetensors

TINY = dict(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37)


def test_the_reader_equals_safetensors_for_every_dtype_and_shape(tmp_path):
    tensors = {
        "f32": torch.randn(3, 4),
        "bf16": torch.randn(5).to(torch.bfloat16),
        "f16": torch.randn(2, 2).half(),
        "i64": torch.arange(7),
        "i8": torch.tensor([-3, 4], dtype=torch.int8),
        "bool": torch.tensor([True, False]),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 5),
    }
    save_file(tensors, tmp_path / "w.safetensors", metadata={"format": "pt"})
    ours, theirs = read_safetensors(tmp_path / "w.safetensors"), load_file(tmp_path / "w.safetensors")
    assert sorted(ours) == sorted(theirs)
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype and ours[name].shape == tensor.shape
        assert torch.equal(ours[name], tensor), name


def test_a_truncated_file_is_a_value_error_naming_the_tensor(tmp_path):
    save_file({"a": torch.randn(64), "b": torch.randn(64)}, tmp_path / "w.safetensors")
    data = (tmp_path / "w.safetensors").read_bytes()
    (tmp_path / "w.safetensors").write_bytes(data[:-10])
    with pytest.raises(ValueError, match="ends inside tensor 'b'"):
        read_safetensors(tmp_path / "w.safetensors")


def test_a_loaded_model_equals_the_saved_one_in_fp32_with_its_buffer(tmp_path):
    """Built on the meta device and given the file's tensors: every parameter real, in fp32 (a file in fp16
    too), the position-ids buffer made, and the outputs those of the model that was saved."""
    torch.manual_seed(0)
    saved = BertForPreTraining(BertConfig(**TINY)).eval()
    saved.save_pretrained(tmp_path / "m")
    half = {k: v.half() for k, v in load_file(tmp_path / "m" / "model.safetensors").items()}
    (tmp_path / "h").mkdir()
    (tmp_path / "h" / "config.json").write_text((tmp_path / "m" / "config.json").read_text())
    save_file(half, tmp_path / "h" / "model.safetensors")
    ids = torch.randint(0, TINY["vocab_size"], (2, 9))
    for path, tolerance in ((tmp_path / "m", 0.0), (tmp_path / "h", 1e-2)):
        model = load_model(path)
        assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
        assert {p.dtype for p in model.parameters()} == {torch.float32}
        assert torch.equal(model.bert.embeddings.position_ids, torch.arange(BertConfig(**TINY).max_position_embeddings))
        with torch.no_grad():
            got, want = model(ids).prediction_logits, saved(ids).prediction_logits
        torch.testing.assert_close(got, want, atol=tolerance, rtol=tolerance)
