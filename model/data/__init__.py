"""Training data: pretraining corpora (tokenised once, cached as numpy arrays) and fine-tuning tables.

    corpus = load_corpus("wiki.txt", tokenizer)                    # any of the four corpus formats
    corpus = open_store("wiki.store", tokenizer)                   # or a sharded token store (a directory)
    data = PretrainingData(corpus, tokenizer, batch_size=32, max_seq_len=128, seed=0)
    for batch in data.iter_batches(epoch, start_batch):             # or: for batch in data (stateful)
        model(**batch)                                              # BertForPreTraining keyword names

    ft = load_classification_data("train.csv", eval_path=None, eval_fraction=0.1, group_column=None)
    config.id2label, config.label2id = ft.id2label, ft.label2id
    batches = ClassificationBatches(ft.train, tokenizer, batch_size=32, max_seq_len=128)

    tc = load_token_classification_data("train.conll")             # or .jsonl {"tokens": [...], "tags": [...]}
    examples = encode_tagged(tc.train, tokenizer, tc.label2id, max_seq_len=128)  # first-piece labels, parts
    batches = TokenClassificationBatches(tc.train, tokenizer, tc.label2id, batch_size=32)

    qa = load_qa_data("train-v2.0.json")                          # SQuAD v1.1 / v2.0, checked
    batches = QABatches(qa.train, tokenizer, max_seq_len=384, doc_stride=128)  # run_qa.py's windows

Modules: corpus (formats, sentence splitting, cache), store (sharded token stores), pretraining (packing, NSP, masking),
finetune (tables, labels, splits), token_classification (CoNLL/JSONL tags, IOB2, word alignment),
question_answering (SQuAD JSON, windows, answer positions),
batches (resumable batch streams), corpus_build (sharded token stores from raw text at scale), wikixml
(Wikipedia XML dumps), synthetic (template NER and SQuAD sets with held-out entities).

The names below load on first use, as in model/__init__.py: a process that needs only the corpus readers
(a `bert corpus build` worker) does not pull in torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "ResumableBatches": ".batches",
    "FORMATS": ".corpus",
    "TokenizedCorpus": ".corpus",
    "detect_format": ".corpus",
    "encode_sentences": ".corpus",
    "load_corpus": ".corpus",
    "read_documents": ".corpus",
    "split_sentences": ".corpus",
    "tokenizer_fingerprint": ".corpus",
    "ClassificationBatches": ".finetune",
    "ClassificationData": ".finetune",
    "LabeledExample": ".finetune",
    "build_label_map": ".finetune",
    "load_classification_data": ".finetune",
    "read_table": ".finetune",
    "split_holdout": ".finetune",
    "IGNORE_INDEX": ".pretraining",
    "InstancePlan": ".pretraining",
    "MaskingVocab": ".pretraining",
    "PretrainingData": ".pretraining",
    "collate_pretraining": ".pretraining",
    "mask_tokens": ".pretraining",
    "plan_instances": ".pretraining",
    "truncate_seq_pair": ".pretraining",
    "TaggedSentence": ".token_classification",
    "TokenClassificationData": ".token_classification",
    "TokenClassificationExample": ".token_classification",
    "build_tag_map": ".token_classification",
    "encode_tagged": ".token_classification",
    "load_token_classification_data": ".token_classification",
    "read_tagged": ".token_classification",
    "TokenClassificationBatches": ".token_classification",
    "QABatches": ".question_answering",
    "QAData": ".question_answering",
    "QAExample": ".question_answering",
    "QAWindow": ".question_answering",
    "encode_squad": ".question_answering",
    "load_qa_data": ".question_answering",
    "read_squad": ".question_answering",
    "TokenStore": ".store",
    "is_store": ".store",
    "open_store": ".store",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        try:  # a submodule (`model.data.pretraining`) not imported yet
            return importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
