# syntax=docker/dockerfile:1
# Bamboo's container image: the `bamboo` command as the ENTRYPOINT, run as user 1000.
#
# CPU (the default; the coordinator needs no GPU, and CPU agents use it too):
#   docker build -t ghcr.io/your-org/bamboo:0.1.0 .
#
# GPU (the agents on NVIDIA nodes): a CUDA runtime base and the CUDA build of torch. Pick
# the CUDA version that the pinned torch release is published for and that your nodes'
# driver supports (https://download.pytorch.org/whl/ lists cu126, cu128, ...):
#   docker build -t ghcr.io/your-org/bamboo:0.1.0-cuda \
#     --build-arg BASE=nvidia/cuda:12.8.1-runtime-ubuntu24.04 \
#     --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 .
# (torch's CUDA wheels bring their own CUDA libraries, so python:3.11-slim with only
# TORCH_INDEX changed also runs on GPUs; the nvidia/cuda base adds the NVIDIA_* settings
# that plain `docker run --gpus` expects.) A base without Python gets python3 from apt;
# Ubuntu 24.04's is 3.12, which the package accepts (requires-python >= 3.11).
#
# torch comes from TORCH_INDEX through --extra-index-url: constraints.txt pins
# torch==2.13.0, which that index serves as 2.13.0+cpu / 2.13.0+cuXXX (pip prefers the
# local build over PyPI's plain 2.13.0 of the same version).
ARG BASE=python:3.11-slim
FROM ${BASE}

ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/bamboo/venv \
    PATH=/opt/bamboo/venv/bin:$PATH

# A Python with venv and ensurepip (python:3.11-slim has them; nvidia/cuda images have no
# Python), a virtual environment, then the user 1000 the pods run as (Ubuntu 24.04 images
# already have one, `ubuntu`) and its working directory.
# hadolint ignore=DL3008
RUN set -eux; \
    if ! python3 -c 'import ensurepip, venv' >/dev/null 2>&1; then \
        apt-get update; \
        DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 python3-venv; \
        rm -rf /var/lib/apt/lists/*; \
    fi; \
    python3 -m venv /opt/bamboo/venv; \
    getent passwd 1000 >/dev/null || useradd --uid 1000 --user-group --create-home --shell /bin/sh bamboo; \
    install -d -o 1000 -g 1000 /workspace

WORKDIR /opt/bamboo/src

# torch first, in its own layer: it is most of the image and changes least. Ray beside it,
# for KubeRay's pods (deploy/kuberay: `bamboo train --ray auto`), at the `ray` extra's pin.
COPY constraints.txt ./
RUN pip install --no-cache-dir -c constraints.txt --extra-index-url "${TORCH_INDEX}" torch ray

COPY pyproject.toml README.md ./
COPY src ./src
RUN pip install --no-cache-dir -c constraints.txt --extra-index-url "${TORCH_INDEX}" . \
    && rm -rf /opt/bamboo/src/build /opt/bamboo/src/*.egg-info \
    && bamboo --help >/dev/null

WORKDIR /workspace
USER 1000:1000

# 29400 join, 29401 store, 29402 /healthz and /metrics (docs/deploy.md lists every port;
# workers also talk to each other on ephemeral ports, which EXPOSE cannot list).
EXPOSE 29400 29401 29402

# Exec form: `bamboo` is PID 1 and receives SIGTERM itself (the agents' preStop hook
# sends it `kill -TERM 1`).
ENTRYPOINT ["bamboo"]
CMD ["--help"]
