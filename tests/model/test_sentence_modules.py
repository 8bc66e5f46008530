"""model/sentence_modules.py against sentence-transformers: every pooling mode equals its Pooling module on the
same tensors; the reader reads both forms of a Pooling config and refuses modules this project cannot run; a
directory the writer wrote loads in SentenceTransformer and encodes as SentenceModules.embed does; an
import keeps the modules (written in their plain form) and refuses the others before anything is published."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from sentence_transformers import SentenceTransformer

# sentence_transformers.models.Pooling, at the path sentence-transformers 6 keeps it (the old one warns)
from sentence_transformers.sentence_transformer.modules import Pooling as STPooling

from model.errors import UserError
from model.model_dir import import_model, read_prompts
from model.modeling import BertModel
from model.sentence_modules import (
    MODULES_FILE,
    POOLING_MODES,
    SENTENCE_TRANSFORMERS_CONFIG,
    Pooling,
    SentenceModules,
    pool,
    pooling_config,
    read_sentence_modules,
    write_sentence_modules,
)
from model.sources import import_source
from model.tokenizer import BertTokenizer
from tests.app.conftest import save_tiny

TEXTS = ["the cat sat on the mat .", "a dog", "the man is eating food in the big house with a red car ."]
DENSE = {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}


def st_pooling(pooling: Pooling, hidden: torch.Tensor, mask: torch.Tensor, prompt_length: int | None) -> torch.Tensor:
    modes = pooling.modes[0] if len(pooling.modes) == 1 else pooling.modes
    module = STPooling(hidden.shape[-1], pooling_mode=modes, include_prompt=pooling.include_prompt)
    features = {"token_embeddings": hidden, "attention_mask": mask}
    if prompt_length is not None:
        features["prompt_length"] = prompt_length
    return module(features)["sentence_embedding"]


POOLINGS = [Pooling((mode,)) for mode in POOLING_MODES] + [
    Pooling(("cls", "max", "mean")),  # several modes concatenate, in their order
    Pooling(("lasttoken", "mean_sqrt_len_tokens", "weightedmean")),
]


@pytest.mark.parametrize("pooling", POOLINGS, ids=lambda p: "+".join(p.modes))
@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("prompt", [None, 2], ids=["no-prompt", "prompt-2"])
def test_each_mode_equals_sentence_transformers_pooling(pooling, side, prompt):
    torch.manual_seed(0)
    hidden = torch.randn(4, 7, 8)
    lengths = [7, 5, 3, 2]
    mask = torch.tensor([[1] * n + [0] * (7 - n) for n in lengths])
    mask = mask if side == "right" else mask.flip(1)
    for include_prompt in (True, False):
        p = Pooling(pooling.modes, include_prompt)
        expected = st_pooling(p, hidden, mask, prompt)
        assert pool(hidden, mask, p, prompt).shape == (4, p.dimension(8))
        torch.testing.assert_close(pool(hidden, mask, p, prompt), expected, rtol=0, atol=1e-6)
    # 16-bit vectors are pooled in float32 and given back in their own type, as sentence-transformers does
    half = hidden.to(torch.bfloat16)
    torch.testing.assert_close(pool(half, mask, pooling), st_pooling(pooling, half, mask, None), rtol=0, atol=0)


def test_pooling_refuses_what_sentence_transformers_does_not_have():
    with pytest.raises(ValueError) as e:
        Pooling(("mean", "median"))
    assert str(e.value) == (
        "pooling modes must be one or more of cls, max, mean, mean_sqrt_len_tokens, weightedmean, lasttoken, "
        "got ['mean', 'median']"
    )
    with pytest.raises(ValueError, match=r"got \[\]$"):
        Pooling(())
    assert Pooling("cls").modes == ("cls",) and Pooling(["cls", "max"]).modes == ("cls", "max")  # type: ignore[arg-type]


def test_minilm_reads_as_mean_pooling_and_normalize(minilm_dir):
    modules = read_sentence_modules(minilm_dir)
    assert modules == SentenceModules(Pooling(("mean",)), normalize=True, max_seq_length=256, do_lower_case=False)


def test_a_directory_without_modules_json_gets_the_default(tmp_path):
    (tmp_path / "1_Pooling").mkdir()  # without modules.json nothing else is read, as sentence-transformers does
    (tmp_path / "1_Pooling" / "config.json").write_text('{"pooling_mode_cls_token": true}')
    assert read_sentence_modules(tmp_path) == SentenceModules() == SentenceModules(Pooling(("mean",)), True, None)


def write_modules(path: Path, modules: list[dict], pooling: dict | None = None, bert: dict | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / MODULES_FILE).write_text(json.dumps(modules))
    if pooling is not None:
        (path / "1_Pooling").mkdir(exist_ok=True)
        (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    if bert is not None:
        (path / "sentence_bert_config.json").write_text(json.dumps(bert))
    return path


TRANSFORMER = {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}
POOLING = {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
NORMALIZE = {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}


def test_both_forms_of_a_pooling_config(tmp_path):
    legacy = {"word_embedding_dimension": 32, "pooling_mode_max_tokens": True, "pooling_mode_cls_token": True}
    d = write_modules(tmp_path / "legacy", [TRANSFORMER, POOLING], legacy, {"max_seq_length": 128})
    assert read_sentence_modules(d) == SentenceModules(Pooling(("cls", "max")), normalize=False, max_seq_length=128)
    none_set = {"word_embedding_dimension": 32, "pooling_mode_mean_tokens": False}  # none set: mean
    assert (
        read_sentence_modules(write_modules(tmp_path / "none", [TRANSFORMER, POOLING], none_set)).pooling == Pooling()
    )
    # sentence-transformers 6's form, the class under its newer module paths; pooling_mode wins over the flags
    newer = [
        {**TRANSFORMER, "type": "sentence_transformers.base.modules.transformer.Transformer"},
        {**POOLING, "type": "sentence_transformers.sentence_transformer.modules.Pooling"},
        {**NORMALIZE, "type": "sentence_transformers.base.modules.Normalize"},
    ]
    config = {"embedding_dimension": 32, "pooling_mode": ["mean", "cls"], "include_prompt": False}
    d = write_modules(tmp_path / "newer", newer, {**config, "pooling_mode_max_tokens": True})
    assert read_sentence_modules(d) == SentenceModules(Pooling(("mean", "cls"), include_prompt=False), True)


@pytest.mark.parametrize(
    "modules,pooling,bert,message",
    [
        (
            [TRANSFORMER, POOLING, DENSE, NORMALIZE],
            {},
            None,
            "modules.json: module 2 is sentence_transformers.models.Dense, which this service cannot run (it runs a "
            "Transformer, then a Pooling, then an optional Normalize); its embeddings would differ from "
            "sentence-transformers'",
        ),
        (
            [TRANSFORMER, {**POOLING, "type": "my_package.MeanPooling"}],
            {},
            None,
            "modules.json: module 1 is my_package.MeanPooling, which this service cannot run (it runs a Transformer, "
            "then a Pooling, then an optional Normalize); its embeddings would differ from sentence-transformers'",
        ),
        (
            [TRANSFORMER, NORMALIZE, POOLING],
            {},
            None,
            "modules.json lists Transformer, Normalize, Pooling: this service runs a Transformer, then a Pooling, "
            "then an optional Normalize, in that order",
        ),
        (
            [TRANSFORMER],
            None,
            None,
            "modules.json lists Transformer: this service runs a Transformer, then a Pooling, then an optional "
            "Normalize, in that order",
        ),
        ([TRANSFORMER, POOLING], None, None, "modules.json names 1_Pooling/config.json, which is missing"),
        (
            [TRANSFORMER, {**POOLING, "path": "../elsewhere"}],
            {},
            None,
            "modules.json: module path '../elsewhere' is outside the model directory",
        ),
        (
            [TRANSFORMER, POOLING],
            {"pooling_mode_mean_tokens": "yes"},
            None,
            "1_Pooling/config.json: pooling_mode_mean_tokens must be true or false, got 'yes'",
        ),
        (
            [TRANSFORMER, POOLING],
            {"pooling_mode": "median"},
            None,
            "1_Pooling/config.json: pooling modes must be one or more of cls, max, mean, mean_sqrt_len_tokens, "
            "weightedmean, lasttoken, got ['median']",
        ),
        (
            [TRANSFORMER, POOLING],
            {},
            {"max_seq_length": 0},
            "sentence_bert_config.json: max_seq_length must be a positive integer or null, got 0",
        ),
        (
            {"type": "x"},
            None,
            None,
            "modules.json must be a list of modules, each with a type and a path; got {'type': 'x'}",
        ),
    ],
    ids=["dense", "custom", "order", "no-pooling", "no-config", "outside", "flag", "mode", "max-seq", "not-a-list"],
)
def test_what_cannot_be_run_is_refused_naming_it(tmp_path, modules, pooling, bert, message):
    d = write_modules(tmp_path, modules, pooling, bert)
    with pytest.raises(ValueError) as e:
        read_sentence_modules(d)
    assert str(e.value) == message


def tiny_dir(path: Path, seed: int = 3) -> tuple[Path, BertModel]:
    return path, save_tiny(path, BertModel, seed=seed)


def embed_ours(
    path: Path, model: BertModel, modules: SentenceModules, texts: list[str], prompt: str = ""
) -> torch.Tensor:
    """SentenceModules.embed on the model's own padded batch, a prompt put before each text (its length as
    the service counts it: [CLS] and the prompt's tokens)."""
    tok = BertTokenizer.from_pretrained(path)
    rows = [tok.encode(prompt + t)["input_ids"] for t in texts]
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    with torch.no_grad():
        hidden = model(ids, mask).last_hidden_state
    return modules.embed(hidden, mask, len(tok.token_ids(prompt)) + 1 if prompt else None)


WRITTEN = [
    SentenceModules(Pooling(("cls",)), normalize=False),
    SentenceModules(Pooling(("max", "weightedmean")), normalize=True, max_seq_length=24),
    SentenceModules(Pooling(("mean", "lasttoken"), include_prompt=False), normalize=True),  # pooling_mode's form
    SentenceModules(Pooling(("mean_sqrt_len_tokens",)), normalize=False, do_lower_case=True),
]


@pytest.mark.parametrize("modules", WRITTEN, ids=lambda m: "+".join(m.pooling.modes))
def test_a_written_directory_loads_in_sentence_transformers_and_encodes_as_we_do(tmp_path, modules):
    path, model = tiny_dir(tmp_path / "m")
    write_sentence_modules(path, modules)
    assert read_sentence_modules(path) == modules
    st = SentenceTransformer(str(path), device="cpu")
    expected = st.encode(TEXTS, convert_to_tensor=True)
    assert expected.shape == (3, modules.pooling.dimension(32))
    torch.testing.assert_close(embed_ours(path, model, modules, TEXTS), expected, rtol=0, atol=1e-5)
    if not modules.pooling.include_prompt:  # the prompt's tokens are left out as sentence-transformers leaves them
        expected = st.encode(TEXTS, prompt="the big dog ", convert_to_tensor=True)
        torch.testing.assert_close(embed_ours(path, model, modules, TEXTS, "the big dog "), expected, rtol=0, atol=1e-5)
    config = json.loads((path / "1_Pooling" / "config.json").read_text())
    assert config == pooling_config(modules.pooling, 32)


def test_the_flags_form_is_written_when_the_modes_are_in_its_order():
    assert pooling_config(Pooling(("cls", "mean")), 384) == {
        "word_embedding_dimension": 384,
        "pooling_mode_cls_token": True,
        "pooling_mode_max_tokens": False,
        "pooling_mode_mean_tokens": True,
        "pooling_mode_mean_sqrt_len_tokens": False,
        "pooling_mode_weightedmean_tokens": False,
        "pooling_mode_lasttoken": False,
        "include_prompt": True,
    }
    assert pooling_config(Pooling(("mean", "cls")), 384) == {
        "embedding_dimension": 384,
        "pooling_mode": ["mean", "cls"],
        "include_prompt": True,
    }


def test_the_writer_keeps_the_prompts_and_rewrites_the_modules(tmp_path):
    path, _ = tiny_dir(tmp_path / "m")
    prompts = {"prompts": {"query": "the cat "}, "default_prompt_name": "query", "similarity_fn_name": "dot"}
    (path / SENTENCE_TRANSFORMERS_CONFIG).write_text(json.dumps(prompts))
    write_sentence_modules(path, SentenceModules(normalize=True))
    assert (path / "2_Normalize").is_dir()
    write_sentence_modules(path, SentenceModules(Pooling(("cls",)), normalize=False))  # written again: no Normalize
    assert read_sentence_modules(path) == SentenceModules(Pooling(("cls",)), normalize=False)
    assert json.loads((path / SENTENCE_TRANSFORMERS_CONFIG).read_text()) == prompts
    assert read_prompts(path) == ({"query": "the cat "}, "query")
    st = SentenceTransformer(str(path), device="cpu")
    assert (st.prompts["query"], st.default_prompt_name, len(st)) == ("the cat ", "query", 2)


def test_import_keeps_the_modules_in_their_plain_form(tmp_path, minilm_dir):
    src = tmp_path / "src"
    shutil.copytree(minilm_dir, src, ignore=shutil.ignore_patterns("model.safetensors"))
    save_tiny(tmp_path / "weights", BertModel, seed=1, vocab_size=30522, max_position_embeddings=512)
    shutil.copy(tmp_path / "weights" / "model.safetensors", src)
    (src / "config.json").write_text((tmp_path / "weights" / "config.json").read_text())
    import_model(src, tmp_path / "dst")
    assert read_sentence_modules(tmp_path / "dst") == read_sentence_modules(minilm_dir)
    assert json.loads((tmp_path / "dst" / MODULES_FILE).read_text())[2]["type"] == NORMALIZE["type"]
    save_tiny(tmp_path / "plain", BertModel)  # no modules.json: none written
    import_model(tmp_path / "plain", tmp_path / "plain-dst")
    assert not (tmp_path / "plain-dst" / MODULES_FILE).exists()


def test_import_refuses_a_module_it_cannot_run_before_writing_anything(tmp_path):
    path, _ = tiny_dir(tmp_path / "src")
    write_sentence_modules(path, SentenceModules())
    listed = json.loads((path / MODULES_FILE).read_text())
    (path / MODULES_FILE).write_text(json.dumps([*listed[:2], DENSE, {**listed[2], "idx": 3}]))
    with pytest.raises(UserError) as e:
        import_model(path, tmp_path / "dst", label="acme/dense")
    assert str(e.value) == (
        "modules.json: module 2 is sentence_transformers.models.Dense, which this service cannot run (it runs a "
        "Transformer, then a Pooling, then an optional Normalize); its embeddings would differ from "
        "sentence-transformers'"
    )
    assert not (tmp_path / "dst").exists()


def test_import_refuses_lowercasing_that_its_tokenizer_would_not_do(tmp_path):
    path, _ = tiny_dir(tmp_path / "src")
    tokenizer = BertTokenizer.from_pretrained(path)
    BertTokenizer(tokenizer.backend_tokenizer, lowercase=False).save_pretrained(path)  # a cased tokenizer
    write_sentence_modules(path, SentenceModules(do_lower_case=True))
    with pytest.raises(UserError) as e:
        import_model(path, tmp_path / "dst")
    assert str(e.value) == (
        "sentence_bert_config.json says do_lower_case true but the tokenizer is cased: sentence-transformers "
        "lowercases every text first, which this service does not (use an uncased tokenizer, or set do_lower_case "
        "false)"
    )


def test_a_hub_model_with_a_dense_module_is_refused_before_its_weights_download(hub, hub_env, tmp_path):
    path, _ = tiny_dir(tmp_path / "repo")
    write_sentence_modules(path, SentenceModules(Pooling(("cls",)), normalize=False))
    hub.add_dir("acme/bert-cls-pooling", {"main": path})
    listed = json.loads((path / MODULES_FILE).read_text())
    (path / MODULES_FILE).write_text(json.dumps([*listed, DENSE]))
    hub.add_dir("acme/bert-dense", {"main": path})
    start = len(hub.requests)
    with pytest.raises(UserError) as e:
        import_source(tmp_path / "data", "acme/bert-dense", "dense")
    assert str(e.value).startswith("acme/bert-dense: modules.json: module 2 is sentence_transformers.models.Dense")
    assert not [p for m, p in hub.requests[start:] if p.startswith("/cdn/")]  # no weights fetched
    assert not (tmp_path / "data" / "models" / "dense").exists()
    version, _ = import_source(tmp_path / "data", "acme/bert-cls-pooling", "cls")
    assert read_sentence_modules(version) == SentenceModules(Pooling(("cls",)), normalize=False)
