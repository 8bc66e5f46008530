"""What an import checks before it allocates (model/config.py's bounds, model/model_dir.py's checks,
model/weights.py's shapes): a hostile config.json or weights file is refused by what it says, before
a tensor is read or a module built, with a message that names the value and the bound."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from model import modeling
from model.config import MAX_CONFIG_BYTES, MAX_LABELS, SIZE_BOUNDS, BertConfig
from model.errors import UserError
from model.model_dir import MAX_IMPORT_WEIGHT_BYTES, import_model
from model.sizing import ARCHITECTURES
from model.sources import import_source
from model.weights import expected_shapes, safetensors_shapes
from tests import hub_server as H
from tests.helpers import tiny_config


@pytest.fixture
def tiny_dir(tmp_path) -> Path:
    return H.tiny_model_dir(tmp_path, 0)


@pytest.fixture
def nothing_built(monkeypatch):
    """Fail the test if a module is built or a weights file read."""

    def refuse(*args, **kwargs):
        raise AssertionError("the import built a model or read tensors before refusing")

    monkeypatch.setattr(modeling.BertPreTrainedModel, "__init__", refuse)
    monkeypatch.setattr("model.weights.load_file", refuse)
    monkeypatch.setattr(torch, "load", refuse)


def with_config(src: Path, dst: Path, **changes) -> Path:
    """A copy of model directory `src` whose config.json has `changes`."""
    dst.mkdir()
    for file in src.iterdir():
        (dst / file.name).write_bytes(file.read_bytes())
    config = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, **changes}))
    return dst


def tar_of(model: Path, archive: Path) -> Path:
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(model, arcname="model")
    return archive


def refused(data: Path, source: Path, name: str = "m", **kwargs) -> str:
    """import_source's UserError message; asserts nothing was published or left behind."""
    with pytest.raises(UserError) as e:
        import_source(data, str(source), name, **kwargs)
    assert not (data / "models" / name).exists()
    assert not list(data.glob(".tmp-*"))
    return str(e.value)


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


# -- imports refused by their config ----------------------------------------------------------------


def test_ten_thousand_layers_are_refused_before_anything_is_built(tmp_path, tiny_dir, nothing_built):
    archive = tar_of(with_config(tiny_dir, tmp_path / "deep", num_hidden_layers=10_000), tmp_path / "deep.tar.gz")
    assert refused(tmp_path / "data", archive) == (
        "num_hidden_layers is 10,000, more than the 48 a model may have (BERT-large has 24)"
    )


def test_three_million_labels_are_refused(tmp_path, tiny_dir, nothing_built):
    archive = tar_of(with_config(tiny_dir, tmp_path / "wide", num_labels=3_000_000), tmp_path / "wide.tar.gz")
    assert "num_labels is 3,000,000, more than the 10,000 a model may have" in refused(tmp_path / "data", archive)


def test_a_model_over_the_memory_budget_is_refused_naming_both(tmp_path, tiny_dir, nothing_built):
    message = refused(tmp_path / "data", tiny_dir, memory_budget=10_000)
    assert message == (
        "config.json describes a model of 20.5 K parameters: an estimated 80.1 KB of fp32 weights, "
        "more than the 9.8 KB model memory budget"
    )


def test_without_a_budget_the_fixed_cap_holds(tmp_path, tiny_dir, nothing_built):
    big = with_config(tiny_dir, tmp_path / "big", num_hidden_layers=48, hidden_size=4096, intermediate_size=16384)
    message = refused(tmp_path / "data", big)
    assert "parameters: an estimated 36.14 GB of fp32 weights, more than the 4.00 GB an import may take" in message
    assert MAX_IMPORT_WEIGHT_BYTES == 4 << 30


def test_within_the_budget_it_imports(tmp_path, tiny_dir):
    version, summary = import_source(tmp_path / "data", str(tiny_dir), "m", memory_budget=1 << 20)
    assert summary["layers"] == 2 and (version / "model.safetensors").is_file()


# -- imports refused by their weights ---------------------------------------------------------------


def test_expected_shapes_are_every_class_s_own():
    for config in (tiny_config(), tiny_config(id2label={0: "a", 1: "b", 2: "c"})):
        for architecture, parts in ARCHITECTURES.items():
            model = getattr(modeling, architecture)(config)
            prefix = "bert." if model.prefix == "" else ""
            state = {prefix + k: tuple(v.shape) for k, v in model.state_dict().items()}
            expected = expected_shapes(config, parts)
            assert {k: expected[k] for k in state} == state, architecture


def test_safetensors_shapes_read_the_header_only(tiny_dir, monkeypatch):
    want = {k: tuple(v.shape) for k, v in load_file(tiny_dir / "model.safetensors").items()}
    monkeypatch.setattr("model.weights.load_file", lambda *a: pytest.fail("read tensors"))
    assert safetensors_shapes(tiny_dir / "model.safetensors") == want


def weights_with(src: Path, dst: Path, **tensors: torch.Tensor) -> Path:
    """A copy of `src` whose model.safetensors has these tensors (names with '__' for '.') besides or instead."""
    with_config(src, dst)
    state = load_file(src / "model.safetensors")
    save_file({**state, **{k.replace("__", "."): v for k, v in tensors.items()}}, dst / "model.safetensors")
    return dst


def test_a_tensor_far_bigger_than_the_config_is_refused(tmp_path, tiny_dir, nothing_built):
    big = weights_with(tiny_dir, tmp_path / "big", bert__embeddings__word_embeddings__weight=torch.zeros(50_000, 32))
    archive = tar_of(big, tmp_path / "big.tar.gz")
    vocab = tiny_config().vocab_size
    assert refused(tmp_path / "data", archive) == (
        "model.safetensors: tensor bert.embeddings.word_embeddings.weight has shape [50000, 32], "
        f"but config.json implies [{vocab}, 32]"
    )


def test_an_unknown_huge_tensor_is_refused(tmp_path, tiny_dir, nothing_built):
    extra = weights_with(tiny_dir, tmp_path / "extra", payload=torch.zeros(1_000_000))
    message = refused(tmp_path / "data", tar_of(extra, tmp_path / "extra.tar.gz"))
    assert message.startswith("model.safetensors: tensor bert.payload has 1,000,000 elements, more ")
    assert "than the largest tensor config.json implies" in message


def test_weights_far_larger_than_the_config_are_refused_unread(tmp_path, tiny_dir, nothing_built):
    bin_dir = with_config(tiny_dir, tmp_path / "bin")
    (bin_dir / "model.safetensors").unlink()
    with open(bin_dir / "pytorch_model.bin", "wb") as f:
        f.truncate(1 << 30)  # sparse: a gigabyte on paper, nothing on disk
    message = refused(tmp_path / "data", bin_dir)
    assert message.startswith("pytorch_model.bin is 1.00 GB (1,073,741,824 bytes), but a BERT of ")
    assert "config.json's sizes takes" in message


def test_weights_far_smaller_than_the_config_are_refused(tmp_path, tiny_dir, nothing_built):
    wide = with_config(tiny_dir, tmp_path / "wide", hidden_size=1024, num_attention_heads=16, intermediate_size=4096)
    save_file({"bert.pooler.dense.bias": torch.zeros(1024)}, wide / "model.safetensors")
    message = refused(tmp_path / "data", wide)
    assert "model.safetensors is 4.1 KB (4,192 bytes), but a BERT of config.json's sizes takes 50,679,808 to" in message


# -- errors name files as the user does ---------------------------------------------------------------


def test_errors_show_no_path_of_this_machine(tmp_path, tiny_dir):
    """Failures from each stage of an archive's import name the archive as the user does, and the files
    in it by their path inside it: none shows where DATA_DIR, the upload or the extracted files are."""
    data = tmp_path / "data"
    cases = {
        "bounds": with_config(tiny_dir, tmp_path / "a", num_hidden_layers=10_000),
        "json": with_config(tiny_dir, tmp_path / "b"),
        "shape": weights_with(tiny_dir, tmp_path / "c", classifier__weight=torch.zeros(5_000, 32)),
        "lacking": tmp_path / "d",
        "vocab": with_config(tiny_dir, tmp_path / "e", vocab_size=50),
        "traversal": tmp_path / "f",
    }
    (cases["json"] / "config.json").write_text("{not json")
    with_config(tiny_dir, cases["lacking"])
    state = load_file(tiny_dir / "model.safetensors")
    del state["bert.encoder.layer.1.output.dense.weight"]
    save_file(state, cases["lacking"] / "model.safetensors")
    messages = {}
    for name, model in cases.items():
        archive = tmp_path / f"{name}.tar.gz"
        if name == "traversal":
            with tarfile.open(archive, "w:gz") as tar:
                tar.add(tiny_dir / "config.json", arcname="../config.json")
        else:
            tar_of(model, archive)
        messages[name] = refused(data, archive)
        upload = refused(data, archive, card_source={"file": "up.tgz"})  # the API's upload, by its own name
        assert upload == messages[name].replace(f"{name}.tar.gz", "up.tgz")
    for message in messages.values():
        assert str(tmp_path) not in message and "/tmp" not in message and "/data" not in message, message
    assert messages["json"].startswith("config.json is not valid JSON: ")
    assert messages["lacking"] == (
        "lacking.tar.gz lacks weights BertForPreTraining needs: bert.encoder.layer.1.output.dense.weight"
    )
    assert messages["traversal"] == (
        "traversal.tar.gz: refused: member '../config.json' would be written outside the model directory"
    )


def test_a_directory_import_keeps_naming_the_directory(tmp_path, tiny_dir):
    """`bert import SRC DST` is the user's own machine: its errors name the paths the user gave."""
    bad = with_config(tiny_dir, tmp_path / "bad")
    (bad / "config.json").write_text("[]")
    with pytest.raises(UserError, match=f"^{bad / 'config.json'} must hold a JSON object$"):
        import_model(bad, tmp_path / "out")


def test_a_hub_model_too_big_is_refused_before_its_weights_download(hub, hub_env, tmp_path):
    start = len(hub.requests)
    with pytest.raises(UserError) as e:
        import_source(tmp_path / "data", H.TINY_REPO, "m", memory_budget=10_000)
    assert str(e.value).startswith(f"{H.TINY_REPO}: config.json describes a model of 20.5 K parameters")
    assert not [p for m, p in hub.requests[start:] if p.startswith("/cdn/")]  # no weights fetched


def test_a_huge_tokenizer_file_is_not_read(tmp_path, tiny_dir, nothing_built):
    with open(tiny_dir / "tokenizer.json", "r+b") as f:
        f.truncate(65 << 20)  # sparse; read whole, it would be 65 MB of memory
    assert refused(tmp_path / "data", tiny_dir) == (
        "tokenizer.json is 68,157,440 bytes, more than the 67,108,864 an import reads"
    )
