# megatron-dapo with SGLang 0.5.23 on a CUDA 13 + cuDNN base (torch, Transformer Engine, SGLang from pip).
#   docker build -t megatron-dapo .
#   docker run --gpus all --ipc=host --ulimit memlock=-1 -v /shared:/shared megatron-dapo \
#       train configs/dapo_qwen2.5_7b.yaml model.path=/shared/Qwen2.5-7B
# Version pairing (the fragile part): SGLang 0.5.23's wheel requires torch==2.14.1 built for CUDA 13
# (its kernel, flashinfer and cutlass requirements are the [cu13] builds) and transformers 5.19.0.
# So the base is a CUDA 13 toolkit + cuDNN image (Transformer Engine compiles against the toolkit),
# torch comes from PyTorch's cu130 index, and sglang goes in WITH its declared requirements, which
# include torch_memory_saver (needed by --enable-memory-saver, on by default for colocation).
# The supported range is megatron_dapo.sglang.version.SUPPORTED_SGLANG (sglang>=0.5.21,<0.6,
# also the `gpu` extra); servers outside it are refused at launch and on connect.
# Change SGLANG_VERSION, TORCH_VERSION and the base image together.
# No apex (Transformer Engine provides the fused kernels) and no TensorBoard (pip install tensorboard
# for logging.tensorboard=true). The hosts need an NVIDIA driver for CUDA 13.0: the R580 branch or
# newer (MIN_DRIVER below; docs/launching.md says the same, a test holds the two together).
ARG BASE_IMAGE=nvcr.io/nvidia/cuda:13.0.2-cudnn-devel-ubuntu24.04
FROM ${BASE_IMAGE}
ARG MIN_DRIVER=580.65.06
LABEL org.opencontainers.image.title="megatron-dapo" \
      com.nvidia.driver.min-version="${MIN_DRIVER}"

ARG SGLANG_VERSION=0.5.23
ARG TORCH_VERSION=2.14.1
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu130
ARG TRANSFORMER_ENGINE_VERSION=2.20.2
ARG MEGATRON_CORE_VERSION=0.16.1
ARG RAY_VERSION=2.46.0

ENV PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    DEBIAN_FRONTEND=noninteractive \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# Ubuntu 24.04's Python 3.12 (sglang needs >= 3.11) in a venv: the system Python refuses pip installs.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev git \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv

# torch first from its CUDA 13 index, so sglang's torch==2.14.1 requirement is already satisfied;
# then sglang with its own requirements (torch_memory_saver, flashinfer, sglang-kernel, ...).
# transformers is sglang's own pin, written out: the project calls from_pretrained(..., dtype=),
# new in 4.56.
# hadolint ignore=DL3013
RUN pip install --upgrade pip \
    && pip install --index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}" \
    && pip install "sglang==${SGLANG_VERSION}" "torch==${TORCH_VERSION}" "transformers==5.19.0" \
    && pip install --no-build-isolation "transformer-engine[pytorch]==${TRANSFORMER_ENGINE_VERSION}" \
    && pip install --no-deps "megatron-core==${MEGATRON_CORE_VERSION}" \
    && pip install "ray[default]==${RAY_VERSION}" \
    && python -c "import torch_memory_saver, sglang; assert sglang.__version__ == '${SGLANG_VERSION}'"

# Non-root user (uid 1000, "dapo"); the project lives in its home so `launch/` scripts find the checkout.
RUN useradd --create-home --uid 1000 --shell /bin/bash dapo
WORKDIR /home/dapo/megatron-dapo
COPY --chown=dapo:dapo pyproject.toml README.md ./
COPY --chown=dapo:dapo megatron_dapo ./megatron_dapo
# The project without dependencies first would miss omegaconf & co.; with them, pip must not touch
# torch/megatron-core/transformers/sglang, which are already satisfied above.
RUN pip install --no-deps . \
    && pip install "omegaconf>=2.3,<2.5" "safetensors>=0.4,<1" "tokenizers>=0.20,<1" "pyarrow>=15" \
        "wandb>=0.18,<1" "rich>=13" "matplotlib>=3.8" "numpy>=1.26" \
    && python -c "import megatron_dapo, megatron.core, sglang, ray; print('imports ok')"
COPY --chown=dapo:dapo configs ./configs
COPY --chown=dapo:dapo launch ./launch
COPY --chown=dapo:dapo docs ./docs

USER 1000:1000
ENV HF_HOME=/home/dapo/.cache/huggingface
ENTRYPOINT ["megatron-dapo"]
CMD ["--help"]
