"""How a model trains: the model-agnostic trainer and its callbacks, crash-safe checkpoints, pretraining and
fine-tuning runs as functions, evaluation, data-parallel ranks under torchrun, the SVG plot of a run, and the
retrieval losses of bi-encoders and cross-encoders."""
