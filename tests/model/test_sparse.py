"""model/sparse.py and the sparse encoder's files (model/sentence_modules.py): SPLADE vectors against
transformers' BertForMaskedLM logits and sentence-transformers' SpladePooling on the same weights, chunked
or not; the kept entries; and a SparseEncoder's files read, written and loaded by sentence-transformers."""

from __future__ import annotations

import json

import pytest
import torch

from model.config import BertConfig
from model.modeling import BertForMaskedLM, load_model
from model.sentence_modules import SentenceModules, Splade, read_sentence_modules, write_sentence_modules
from model.sparse import sparse_entries, splade_entries, splade_vectors
from model.tokenizer import BertTokenizer
from tests.conftest import TINY_VOCAB, tiny_config_dict

transformers = pytest.importorskip("transformers")
sentence_transformers = pytest.importorskip("sentence_transformers")


@pytest.fixture(scope="module")
def mlm_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("mlm")
    torch.manual_seed(3)
    BertForMaskedLM(BertConfig(**tiny_config_dict())).save_pretrained(
        path, tokenizer=BertTokenizer.from_vocab(TINY_VOCAB)
    )
    return path


def ragged_batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Three rows of 21, 6 and 1 real tokens (a 1-token row: [CLS] alone), padded to 21."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, vocab, (3, 21), generator=g)
    mask = torch.zeros(3, 21, dtype=torch.long)
    for row, n in enumerate((21, 6, 1)):
        mask[row, :n] = 1
    return ids * mask, mask


def reference(logits: torch.Tensor, mask: torch.Tensor, splade: Splade) -> torch.Tensor:
    """sentence-transformers' SpladePooling on the (B, T, V) logits."""
    from sentence_transformers.sparse_encoder.modules import SpladePooling

    pooling = SpladePooling(pooling_strategy=splade.strategy, activation_function=splade.activation).eval()
    return pooling({"token_embeddings": logits.clone(), "attention_mask": mask})["sentence_embedding"]


@pytest.mark.parametrize("chunk_values", [1, 3 * len(TINY_VOCAB), 1 << 22])  # a token, 3 tokens, all at once
@pytest.mark.parametrize("splade", [Splade(), Splade("sum", "relu"), Splade("max", "log1p_relu")])
def test_splade_vectors_equal_the_pooling_of_transformers_logits(mlm_dir, chunk_values, splade):
    ours = load_model(mlm_dir).eval()
    theirs = transformers.BertForMaskedLM.from_pretrained(mlm_dir).eval()
    ids, mask = ragged_batch(len(TINY_VOCAB))
    with torch.no_grad():
        hidden = ours.bert(ids, mask).last_hidden_state
        vectors = splade_vectors(ours.cls.predictions, hidden, mask, splade, chunk_values=chunk_values)
        logits = theirs(input_ids=ids, attention_mask=mask).logits
    expected = reference(logits, mask, splade)
    if splade == Splade():  # the definition itself: max over the kept tokens of log(1 + relu(logit))
        direct = torch.log1p(torch.relu(logits)).masked_fill(mask[..., None] == 0, 0).amax(1)
        torch.testing.assert_close(expected, direct)
    assert vectors.shape == (3, len(TINY_VOCAB))
    assert torch.equal(vectors > 0, expected > 0)
    torch.testing.assert_close(vectors, expected, atol=1e-5, rtol=0)


def test_sparse_entries_keep_what_the_threshold_and_top_k_say():
    vectors = torch.tensor([[0.0, 2.0, 0.5, 2.0, 0.0], [1.0, 0.0, 0.25, 3.0, 0.75], [0.0] * 5])
    entries = sparse_entries(vectors, [0.0, 0.5, 0.0], [None, None, None])
    assert entries == [([1, 2, 3], [2.0, 0.5, 2.0]), ([0, 3, 4], [1.0, 3.0, 0.75]), ([], [])]
    entries = sparse_entries(vectors, [0.0, 0.5, 0.0], [2, 10, None])  # equal values: the lower index first
    assert entries == [([1, 3], [2.0, 2.0]), ([3, 0, 4], [3.0, 1.0, 0.75]), ([], [])]


def save_sparse_encoder(src, dst, *, transformer: str = "Transformer"):
    """`src` saved as sentence-transformers 6 saves a SparseEncoder (a fill-mask Transformer, or the older
    MLMTransformer, and a SpladePooling)."""
    from sentence_transformers import SparseEncoder
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.sparse_encoder.modules import MLMTransformer, SpladePooling

    first = (
        Transformer(str(src), transformer_task="fill-mask")
        if transformer == "Transformer"
        else MLMTransformer(str(src))
    )
    SparseEncoder(modules=[first, SpladePooling(pooling_strategy="max")], device="cpu").save(str(dst))


@pytest.mark.parametrize("transformer", ["Transformer", "MLMTransformer"])
def test_a_sparse_encoder_saved_by_sentence_transformers_reads_as_splade(mlm_dir, tmp_path, transformer):
    save_sparse_encoder(mlm_dir, tmp_path / "st", transformer=transformer)
    assert (
        json.loads((tmp_path / "st" / "config_sentence_transformers.json").read_text())["model_type"] == "SparseEncoder"
    )
    modules = read_sentence_modules(tmp_path / "st")
    assert modules.splade == Splade("max", "relu")
    assert modules.pooling_names == ["splade"] and modules.normalize is False


def test_written_sparse_modules_load_in_sentence_transformers_and_encode_as_ours(mlm_dir, tmp_path):
    from sentence_transformers import SparseEncoder

    path = tmp_path / "ours"
    load_model(mlm_dir).save_pretrained(path, tokenizer=BertTokenizer.from_pretrained(mlm_dir))
    write_sentence_modules(path, SentenceModules(normalize=False, splade=Splade()))
    assert read_sentence_modules(path).splade == Splade()
    texts = ["the cat sat on the mat", "a dog", "the quick brown fox jumps over the lazy dog !"]
    encoder = SparseEncoder(str(path), device="cpu")
    expected = encoder.encode(texts, convert_to_tensor=True).to_dense()
    tok, model = BertTokenizer.from_pretrained(path), load_model(path).eval()
    batch = tok(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model.bert(batch["input_ids"], batch["attention_mask"]).last_hidden_state
        ours = splade_vectors(model.cls.predictions, hidden, batch["attention_mask"])
    assert torch.equal(ours > 0, expected > 0)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=0)


def test_sparse_files_that_cannot_run_are_refused(mlm_dir, tmp_path):
    save_sparse_encoder(mlm_dir, tmp_path)
    (tmp_path / "1_SpladePooling" / "config.json").write_text(json.dumps({"pooling_strategy": "mean"}))
    with pytest.raises(ValueError) as e:
        read_sentence_modules(tmp_path)
    assert str(e.value) == (
        "1_SpladePooling/config.json: SPLADE pooling_strategy must be one of max, sum and activation_function one "
        "of relu, log1p_relu, got 'mean' and 'relu'"
    )
    config = json.loads((tmp_path / "sentence_bert_config.json").read_text())
    (tmp_path / "sentence_bert_config.json").write_text(
        json.dumps({**config, "transformer_task": "feature-extraction"})
    )
    with pytest.raises(ValueError) as e:
        read_sentence_modules(tmp_path)
    assert str(e.value) == (
        "sentence_bert_config.json: a SpladePooling needs transformer_task fill-mask, got 'feature-extraction'"
    )


def test_import_pooling_splade_needs_a_masked_lm_head(tmp_path):
    from model.errors import UserError
    from model.model_dir import import_model
    from model.modeling import BertModel

    torch.manual_seed(0)
    BertModel(BertConfig(**tiny_config_dict())).save_pretrained(
        tmp_path / "enc", tokenizer=BertTokenizer.from_vocab(TINY_VOCAB)
    )
    with pytest.raises(UserError) as e:
        import_model(tmp_path / "enc", tmp_path / "dst", label="acme/enc", pooling="splade")
    assert str(e.value) == (
        "SPLADE pooling needs a masked-LM head (cls.predictions.*), and the weights load as a BertModel without one"
    )
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize("chunk_values", [len(TINY_VOCAB), 2 * len(TINY_VOCAB) + 1, 1 << 22])  # 1, 2 rows, all
def test_splade_entries_a_group_of_rows_at_a_time_equal_the_whole_batchs(mlm_dir, chunk_values):
    model = load_model(mlm_dir).eval()
    ids, mask = ragged_batch(len(TINY_VOCAB))
    thresholds, top_ks = [0.0, 0.5, 0.0], [None, None, 3]
    with torch.no_grad():
        hidden = model.bert(ids, mask).last_hidden_state
        whole = sparse_entries(splade_vectors(model.cls.predictions, hidden, mask), thresholds, top_ks)
        grouped = splade_entries(model.cls.predictions, hidden, mask, Splade(), thresholds, top_ks, chunk_values)
    assert [indices for indices, _ in grouped] == [indices for indices, _ in whole]
    for (_, values), (_, expected) in zip(grouped, whole):  # the head's chunks differ: the last bit may
        assert values == pytest.approx(expected, abs=1e-6)
    assert [len(indices) for indices, _ in whole][2] == 3
