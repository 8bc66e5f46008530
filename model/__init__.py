"""bertserve's model package: BERT (Devlin et al., 2018) from scratch in PyTorch, and how it runs and trains.
Importable on its own: it never imports app/ or worker/, nor a web, queue or CLI framework.

    modeling.py, config.py, tokenizer.py, weights.py   the BERT, its hyper-parameters, WordPiece, HF weight files
    model_dir.py, model_card.py, sources.py            a model directory, its measured card, where an import comes from
    dataset_sources.py                                 where an imported dataset comes from: a Hub dataset's split
    sentence_modules.py                                a model's sentence-transformers modules: its pooling, Normalize
    options.py, sizing.py, qa_spans.py, scores.py      training options, sizes from a config, QA answers, task scores
    errors.py                                          errors a user can fix
    compute/    which device, kernels and precision run it (oneDNN dense layers, int8 and bf16)
    training/   the trainer, its callbacks and checkpoints, runs as functions, evaluation, data-parallel ranks
    data/       pretraining corpora and token stores, fine-tuning tables

Where things are kept on disk (job records, versions, datasets) is the top-level `datadir` package.
Import from the module that defines a name (`from model.modeling import BertModel`): this package
imports nothing itself, so `import model.config` does not pull in torch's kernels.
"""
