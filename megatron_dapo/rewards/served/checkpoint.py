"""The checkpoint a classifier reward server loads: the user's, or a copy that corrects SGLang's
score head.

The defect. SGLang 0.5.23 builds the score head of some ``*ForSequenceClassification`` classes as
``nn.Linear(hidden_size, num_labels)``, bias included, while transformers' class has no bias, so
the checkpoint has none. SGLang's loader fills only the tensors the checkpoint holds: the bias
keeps ``nn.Linear``'s random initialisation, and every score is off by a constant that changes at
each server start (issue 37 saw +0.0498 on one start and -0.0438 on the next on a tiny Qwen2;
-0.0332 here on another). Two reward servers, or one restarted, then disagree.

The correction. A *served copy* of the checkpoint directory: symbolic links to every file of the
original, plus one safetensors file holding the missing biases as zeros (what transformers
computes: no bias), and ``model.safetensors.index.json`` written to list it, so that SGLang's
loader (which, given an index, reads only the files the index names) loads it with the rest.

Which architectures, from the SGLang 0.5.23 source (``sglang/srt/models/``) against the
transformers classes (``GenericForSequenceClassification``: ``nn.Linear(hidden, num_labels,
bias=False)``):

- ``Qwen2ForSequenceClassification`` (qwen2_classification.py:47 ``self.score =
  nn.Linear(config.hidden_size, config.num_labels)``): bias the checkpoint lacks -> zero-filled.
- ``Qwen3ForSequenceClassification`` (qwen3_classification.py:136, the same line): zero-filled.
  Its pooler normalises the output unless the config has ``id2label``/``label2id``, which every
  config transformers writes has (it derives them from ``num_labels``).
- ``LlamaForSequenceClassification`` (llama_reward.py:47, ``bias=False``) and
  ``Gemma2ForSequenceClassification`` (gemma2_reward.py:42, ``bias=False``): served as they are.

Refused, because there is no transformers class to compare them with (the start-up check needs
one) or SGLang's class is not the transformers model: ``Qwen2ForRewardModel`` (qwen2_rm.py:47-51)
and ``Qwen3ForRewardModel`` (qwen3_rm.py:37-41) (remote-code heads ``Linear-ReLU-Linear`` with
biases), ``InternLM2ForRewardModel`` (internlm2_reward.py:42, remote code),
``LlamaForSequenceClassificationWithNormal_Weights`` (llama_reward.py:80, a head of its own),
``LlamaForClassification`` (llama_classification.py:48, ``classification_out_size``), the
encoders ``BertForSequenceClassification`` / ``XLMRobertaForSequenceClassification`` (no chat
template to render a conversation with), and every architecture not named here.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from megatron_dapo.rewards.served.outcome import RewardModelError

SGLANG_VERSION = "0.5.23"
INDEX = "model.safetensors.index.json"
BIAS_FILE = "served-score-bias.safetensors"
MANIFEST = "served-checkpoint.json"


@dataclass(frozen=True)
class HeadSpec:
    """What SGLang's class of one architecture holds in its score head that the checkpoint may not.

    Attributes:
        zero_bias: the head's bias parameter SGLang creates and transformers' class does not (so
            a checkpoint never has it), or None when the two agree.
        source: where SGLang builds the head (file:line in ``sglang/srt/models/``).
    """

    zero_bias: str | None
    source: str


HEADS: dict[str, HeadSpec] = {
    "Qwen2ForSequenceClassification": HeadSpec("score.bias", "qwen2_classification.py:47"),
    "Qwen3ForSequenceClassification": HeadSpec("score.bias", "qwen3_classification.py:136"),
    "LlamaForSequenceClassification": HeadSpec(None, "llama_reward.py:47"),
    "Gemma2ForSequenceClassification": HeadSpec(None, "gemma2_reward.py:42"),
}
# architectures SGLang serves with --is-embedding that are refused, and why (one clause each)
REFUSED: dict[str, str] = {
    "Qwen2ForRewardModel": "its head (qwen2_rm.py:47) is remote code with no transformers class to check it against",
    "Qwen3ForRewardModel": "its head (qwen3_rm.py:37) has no transformers class to check it against",
    "InternLM2ForRewardModel": "it is remote code with no transformers class to check it against",
    "LlamaForSequenceClassificationWithNormal_Weights": "its head (llama_reward.py:80) is SGLang's own",
    "LlamaForClassification": "it is SGLang's own head (llama_classification.py:48), not a transformers class",
    "BertForSequenceClassification": "an encoder has no chat template to render prompt and response with",
    "XLMRobertaForSequenceClassification": "an encoder has no chat template to render prompt and response with",
}


@dataclass(frozen=True)
class ServedCheckpoint:
    """The directory a classifier server should load.

    Attributes:
        path: the directory to pass as ``--model-path`` (the original when nothing is corrected).
        original: the user's checkpoint directory.
        architecture: ``config.json``'s ``architectures[0]``.
        zero_filled: the parameters the served copy adds as zeros (empty: served as is).
    """

    path: Path
    original: Path
    architecture: str
    zero_filled: tuple[str, ...]


def architecture(model_dir: str | os.PathLike) -> tuple[str, dict]:
    """``(architectures[0], config)`` of an HF checkpoint directory, or a one-line error."""
    config_file = Path(model_dir) / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise RewardModelError(
            f"reward.model.path={model_dir}: cannot read {config_file} ({e}); point it at an HF checkpoint directory"
        ) from e
    archs = config.get("architectures") or []
    if not archs:
        raise RewardModelError(
            f"reward.model.path={model_dir}: config.json names no architectures; SGLang picks its model "
            "class by architectures[0] (e.g. Qwen2ForSequenceClassification)"
        )
    return archs[0], config


def head_spec(arch: str, model_dir: str | os.PathLike) -> HeadSpec:
    """The head of ``arch`` as SGLang builds it, or a one-line refusal naming why."""
    if arch in HEADS:
        return HEADS[arch]
    why = REFUSED.get(arch, "its SGLang score head has not been compared with transformers'")
    supported = ", ".join(HEADS)
    raise RewardModelError(
        f"reward.model.path={model_dir}: architecture {arch} is not served as a classifier reward: {why} "
        f"(SGLang {SGLANG_VERSION}); supported: {supported}; or use reward.model.kind=judge"
    )


def _weight_map(model_dir: Path) -> dict[str, str]:
    """Tensor name -> safetensors file, from the index or from the single file's header."""
    index = model_dir / INDEX
    if index.is_file():
        return dict(json.loads(index.read_text())["weight_map"])
    files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        raise RewardModelError(
            f"reward.model.path={model_dir}: no safetensors weights (SGLang would load a served copy's "
            "extra file instead of .bin weights); save the model with safe_serialization=True"
        )
    if len(files) > 1:
        raise RewardModelError(
            f"reward.model.path={model_dir}: {len(files)} safetensors files and no {INDEX}; "
            "write the index (save_pretrained does) so it is clear which files are the model"
        )
    from safetensors import safe_open

    with safe_open(str(model_dir / files[0]), framework="pt") as f:
        return {name: files[0] for name in f.keys()}  # noqa: SIM118 - safe_open has no __iter__


def _head_dtype(model_dir: Path, weight_map: dict[str, str], name: str):
    from safetensors import safe_open

    if name not in weight_map:
        raise RewardModelError(
            f"reward.model.path={model_dir}: the checkpoint has no {name}; it is not a sequence-classification "
            "checkpoint of its architecture (save it with AutoModelForSequenceClassification)"
        )
    with safe_open(str(model_dir / weight_map[name]), framework="pt") as f:
        return f.get_slice(name).get_dtype(), f.get_slice(name).get_shape()


def _fingerprint(model_dir: Path) -> str:
    """Identifies the original's files (names, sizes, mtimes): a stale served copy is rebuilt."""
    h = hashlib.sha256()
    for p in sorted(model_dir.iterdir()):
        st = p.stat()
        h.update(f"{p.name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def prepare_served_checkpoint(
    model_dir: str | os.PathLike, served_dir: str | os.PathLike
) -> ServedCheckpoint:
    """The directory to serve ``model_dir`` from as a classifier: ``model_dir`` itself when SGLang's
    head matches the checkpoint, else a served copy in ``served_dir`` (built once, rebuilt when
    the original changes). Refuses, in one line, an architecture that cannot be vouched for.
    """
    import torch
    from safetensors.torch import save_file

    original = Path(model_dir).expanduser().resolve()
    arch, _ = architecture(original)
    spec = head_spec(arch, original)
    weight_map = _weight_map(original)
    dtype_name, shape = _head_dtype(original, weight_map, "score.weight")
    num_labels = int(shape[0])
    if spec.zero_bias is None or spec.zero_bias in weight_map:
        return ServedCheckpoint(original, original, arch, ())

    served = Path(served_dir).expanduser().resolve()
    if served == original:
        raise RewardModelError(f"the served copy of {original} cannot be written into the checkpoint itself")
    manifest = {
        "original": str(original),
        "fingerprint": _fingerprint(original),
        "architecture": arch,
        "zero_filled": [spec.zero_bias],
        "why": f"SGLang {SGLANG_VERSION} {spec.source} gives the head a bias the checkpoint lacks",
    }
    existing = served / MANIFEST
    if existing.is_file() and json.loads(existing.read_text()) == manifest:
        return ServedCheckpoint(served, original, arch, (spec.zero_bias,))

    if served.exists():
        _clear_served_copy(served)
    served.mkdir(parents=True, exist_ok=True)
    for p in sorted(original.iterdir()):
        if p.name in (INDEX, BIAS_FILE, MANIFEST):
            continue
        (served / p.name).symlink_to(p)
    dtype = getattr(torch, _TORCH_DTYPES.get(dtype_name, "float32"))
    save_file({spec.zero_bias: torch.zeros(num_labels, dtype=dtype)}, str(served / BIAS_FILE))
    index = {"metadata": {}, "weight_map": {**weight_map, spec.zero_bias: BIAS_FILE}}
    if (original / INDEX).is_file():
        index["metadata"] = json.loads((original / INDEX).read_text()).get("metadata", {})
    (served / INDEX).write_text(json.dumps(index, indent=2))
    # written last: a copy interrupted before this line is rebuilt next time
    existing.write_text(json.dumps(manifest, indent=2))
    return ServedCheckpoint(served, original, arch, (spec.zero_bias,))


# safetensors' dtype names -> torch's
_TORCH_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}


def _clear_served_copy(served: Path) -> None:
    """Empty a served copy before rebuilding it; refuse a directory that is not one."""
    ours = {INDEX, BIAS_FILE, MANIFEST}
    strangers = [p.name for p in served.iterdir() if not (p.is_symlink() or p.name in ours)]
    if strangers:
        raise RewardModelError(
            f"{served} is not a served copy of a reward model (it holds {strangers[:3]}); "
            "give the served copy a directory of its own"
        )
    for p in served.iterdir():
        p.unlink()
