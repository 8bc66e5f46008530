"""Training data: pretraining corpora (tokenised once, cached as numpy arrays) and fine-tuning tables.

    corpus = load_corpus("wiki.txt", tokenizer)                    # any of the four corpus formats
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

Modules: corpus (formats, sentence splitting, cache), pretraining (packing, NSP, masking),
finetune (tables, labels, splits), token_classification (CoNLL/JSONL tags, IOB2, word alignment),
question_answering (SQuAD JSON, windows, answer positions),
batches (resumable batch streams), synthetic (template NER and SQuAD sets with held-out entities).
"""

from model.data.batches import ResumableBatches
from model.data.corpus import (
    FORMATS,
    TokenizedCorpus,
    detect_format,
    encode_sentences,
    load_corpus,
    read_documents,
    split_sentences,
    tokenizer_fingerprint,
)
from model.data.finetune import (
    ClassificationBatches,
    ClassificationData,
    LabeledExample,
    build_label_map,
    load_classification_data,
    read_table,
    split_holdout,
)
from model.data.pretraining import (
    IGNORE_INDEX,
    InstancePlan,
    MaskingVocab,
    PretrainingData,
    collate_pretraining,
    mask_tokens,
    plan_instances,
    truncate_seq_pair,
)
from model.data.question_answering import (
    QABatches,
    QAData,
    QAExample,
    QAWindow,
    encode_squad,
    load_qa_data,
    read_squad,
)
from model.data.token_classification import (
    TaggedSentence,
    TokenClassificationBatches,
    TokenClassificationData,
    TokenClassificationExample,
    build_tag_map,
    encode_tagged,
    load_token_classification_data,
    read_tagged,
)

__all__ = [
    "FORMATS",
    "IGNORE_INDEX",
    "ClassificationBatches",
    "ClassificationData",
    "InstancePlan",
    "LabeledExample",
    "MaskingVocab",
    "PretrainingData",
    "ResumableBatches",
    "TaggedSentence",
    "TokenClassificationData",
    "TokenClassificationExample",
    "TokenizedCorpus",
    "build_label_map",
    "build_tag_map",
    "collate_pretraining",
    "detect_format",
    "encode_sentences",
    "encode_tagged",
    "load_classification_data",
    "load_corpus",
    "load_token_classification_data",
    "mask_tokens",
    "plan_instances",
    "read_documents",
    "read_table",
    "read_tagged",
    "split_holdout",
    "split_sentences",
    "tokenizer_fingerprint",
    "truncate_seq_pair",
    "QABatches",
    "QAData",
    "QAExample",
    "QAWindow",
    "encode_squad",
    "load_qa_data",
    "read_squad",
    "TokenClassificationBatches",
]
