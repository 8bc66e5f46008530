"""The inference core: the running service, the batching engine, the model registry, and one pipeline per task."""
