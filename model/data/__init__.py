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

    pairs = load_pairs("triplets.csv")                            # anchor, positive, negative(_1..n)
    scored = load_scored_pairs("stsb.csv")                        # sentence1, sentence2, score in 0..1
    queries, corpus, relevant = load_retrieval("scifact/")        # a BEIR folder (its test split) or a .jsonl

Modules: corpus (formats, sentence splitting, cache), store (sharded token stores), pretraining (packing, NSP, masking),
finetune (tables, labels, splits), token_classification (CoNLL/JSONL tags, IOB2, word alignment),
question_answering (SQuAD JSON, windows, answer positions), pairs (sentence-transformers' pairs and
scored pairs), cross_encoder_data (a reranker's pairs and their batches, in-batch negatives included),
retrieval_data (BEIR folders and retrieval JSONL: queries, corpus, relevance),
batches (resumable batch streams), corpus_build (sharded token stores from raw text at scale), wikixml
(Wikipedia XML dumps), hub_layout (a Hub dataset repo's subsets, splits and ClassLabel names), hub_rows (a Hub
split's Parquet, JSON Lines or CSV rows written as an upload's file of a kind).

Import from the module that defines a name (`from model.data.corpus import load_corpus`): this package
imports nothing itself, so a process that needs only the corpus readers (a `bert corpus build` worker)
does not pull in torch.
"""
