# megatron-dapo on NVIDIA's PyTorch container (CUDA, cuDNN, NCCL, Transformer Engine, apex).
#   docker build -t megatron-dapo .
#   docker run --gpus all --ipc=host --ulimit memlock=-1 -v /shared:/shared megatron-dapo \
#       train configs/dapo_qwen2.5_7b.yaml model.path=/shared/Qwen2.5-7B
# Version pairing (the fragile part): sgl-kernel is compiled against one torch minor version, so
# the base image's torch must match SGLang's. 25.01 ships torch 2.6.0a0 + TE 1.14; SGLang
# 0.4.6.post5 / sgl-kernel 0.1.4 are built for torch 2.6. NGC's torch is a pre-release build
# (2.6.0a0+...), which pip does not count as "torch==2.6.0", so packages that pin torch go in with
# --no-deps and their other requirements are listed explicitly; a plain `pip install sglang` would
# replace NGC's torch and break TE/apex. Change the three versions together.
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.01-py3
FROM ${BASE_IMAGE}

ARG SGLANG_VERSION=0.4.6.post5
ARG SGL_KERNEL_VERSION=0.1.4
ARG FLASHINFER_VERSION=0.2.5
ARG MEGATRON_CORE_VERSION=0.16.1
ARG RAY_VERSION=2.46.0

ENV PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    # NGC pins its own packages through this file; it would reject SGLang's torch pin.
    PIP_CONSTRAINT=

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# Torch-pinning packages without their dependencies (see above), then their runtime requirements:
# SGLang's own list for this version, pinned where SGLang pins them and left to pip where it does not.
# transformers is the exception: the project calls from_pretrained(..., dtype=), new in 4.56.
# hadolint ignore=DL3013
RUN pip install --no-deps \
        "sglang==${SGLANG_VERSION}" \
        "sgl-kernel==${SGL_KERNEL_VERSION}" \
        "flashinfer-python==${FLASHINFER_VERSION}" \
        "megatron-core==${MEGATRON_CORE_VERSION}" \
        "torchao==0.9.0" \
    && pip install \
        "transformers==4.57.1" "xgrammar==0.1.19" "llguidance>=0.7.11,<0.8.0" "outlines>=0.0.44,<=0.1.11" \
        "blobfile==3.0.0" "soundfile==0.13.1" "pyzmq>=25.1.2" "prometheus-client>=0.20.0" \
        compressed-tensors datasets fastapi hf_transfer huggingface_hub interegular modelscope msgspec \
        ninja orjson partial_json_parser pillow psutil pydantic pynvml python-multipart uvicorn uvloop \
        cuda-python einops \
        "ray[default]==${RAY_VERSION}"

# Non-root user (uid 1000, "dapo"); the project lives in its home so `launch/` scripts find the checkout.
RUN useradd --create-home --uid 1000 --shell /bin/bash dapo
WORKDIR /home/dapo/megatron-dapo
COPY --chown=dapo:dapo pyproject.toml README.md ./
COPY --chown=dapo:dapo megatron_dapo ./megatron_dapo
# The project without dependencies first would miss omegaconf & co.; with them, pip must not touch
# torch/megatron-core/transformers, which are already satisfied above.
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
