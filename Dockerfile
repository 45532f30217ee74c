# syntax=docker/dockerfile:1
# KVGate image: the README's install command in a venv, the default model converted at build time,
# a non-root user, the disk KV tier and the server secret on the /data volume.
#
#   docker build -t kvgate .                                    # CPU torch (default)
#   docker build -t kvgate:cuda --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 .
#   docker run -p 8000:8000 -v kvgate-data:/data kvgate
#   docker run -p 8000:8000 -v kvgate-data:/data -v $PWD/kvgate.toml:/config/kvgate.toml:ro kvgate
#
# `.ci/dockerfile-steps` runs these instructions outside Docker in a fresh folder (CI has no Docker
# engine). It maps /app, /opt/kvgate, /data and /config into that folder and skips an instruction
# whose line above is `# steps: docker-only`; `# steps: model` marks the default-model step
# (skipped there with --model tiny). See docs/deploy.md.

# Base image: any image with python3 >= 3.10, or one where apt can install it (e.g.
# nvidia/cuda:12.8.1-runtime-ubuntu24.04). PyPI's CUDA torch wheels bundle the CUDA runtime, so the
# slim base also serves GPUs (`docker run --gpus all`) once TORCH_INDEX selects a CUDA build.
ARG BASE_IMAGE=python:3.11-slim
# Extra pip index for torch: the CPU wheels by default (no 2 GB of CUDA libraries in the image);
# a CUDA variant (…/whl/cu128) for GPUs; empty = PyPI's own default build.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu

FROM ${BASE_IMAGE} AS base
# steps: docker-only
RUN if ! python3 -c "import ensurepip, venv" 2>/dev/null; then \
        apt-get update \
        && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
        && rm -rf /var/lib/apt/lists/*; \
    fi
# The native CPU kernels (engine/csrc) are compiled at the first start with the machine's C++
# compiler, into /data/kernels (on the volume: one build per CPU type, reused by later starts).
# Without g++ the engine runs PyTorch's slower attention path instead (docs/engine.md).
# steps: docker-only
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
# steps: docker-only
RUN groupadd --system --gid 10001 kvgate \
    && useradd --system --uid 10001 --gid kvgate --home-dir /home/kvgate --create-home --shell /usr/sbin/nologin kvgate
ENV PYTHONUNBUFFERED=1

FROM base AS build
ARG TORCH_INDEX
# The torch index reaches pip through the environment, so the install line stays the README's.
ENV PIP_EXTRA_INDEX_URL=${TORCH_INDEX} \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    KVGATE_CACHE_DIR=/opt/kvgate
WORKDIR /app
COPY pyproject.toml README.md ./
COPY app ./app
COPY engine ./engine
COPY cache ./cache
COPY tenants ./tenants
# The README's set-up, minus starting the server.
RUN --mount=type=cache,target=/root/.cache/pip \
    python3 -m venv .venv && .venv/bin/pip install -e .
# steps: model
RUN .venv/bin/python -c "from engine.default_model import ensure_default_model; ensure_default_model()"
# /data is the volume: the disk KV tier (/data/kv) and the server secret live there; /data/models
# points at the models baked into the image. /config/kvgate.toml is empty (all defaults) until a
# file is mounted over it.
RUN mkdir -p /opt/kvgate/models /data /config \
    && ln -sfn /opt/kvgate/models /data/models \
    && : > /config/kvgate.toml

FROM base AS runtime
COPY --from=build /app /app
COPY --from=build --chown=kvgate:kvgate /opt/kvgate /opt/kvgate
COPY --from=build --chown=kvgate:kvgate /data /data
COPY --from=build --chown=kvgate:kvgate /config /config
ENV PATH=/app/.venv/bin:$PATH \
    KVGATE_CACHE_DIR=/data \
    KVGATE_CONFIG=/config/kvgate.toml \
    HF_HOME=/data/huggingface
WORKDIR /app
USER kvgate
VOLUME ["/data"]
EXPOSE 8000
# /health answers once the process is up; /ready only once the model is loaded.
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen(os.environ.get('KVGATE_HEALTH_URL', 'http://127.0.0.1:8000/health'), timeout=4)"]
STOPSIGNAL SIGTERM
CMD ["kvgate", "serve", "--host", "0.0.0.0"]
