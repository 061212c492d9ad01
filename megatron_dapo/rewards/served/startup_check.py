"""The start-up check of a classifier reward server: it must score probe conversations as
transformers' ``AutoModelForSequenceClassification`` does on the checkpoint.

Why a check and not only the served copy: a score that is off by a constant looks like any other
score, and RL trains on it without a sign of trouble. The check catches the SGLang head bias
(``checkpoint.py``) on a server given by URL or started from the original directory, a server that
loads another checkpoint than the one named, and an SGLang release whose classes changed. Two
probes: a bias shows as the same offset on both, which is how the message tells it apart.

The reference runs transformers in float32 on this machine's CPU; the tolerance follows the
precision the server computes in (:func:`probe_tolerance`): 1e-4 for float32 (the CPU servers),
4e-2 for float16 and bfloat16, the tolerance SGLang's own reward-model test allows between its
fp16 server and HF's model (sglang test/srt/models/test_reward_models.py). A bfloat16 copy of
the tests' tiny classifier differs from float32 by about 1.6e-3; a real model on a GPU was not
measured here. ``reward.model.probe_tolerance`` overrides it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import httpx

from megatron_dapo.http_errors import http_error
from megatron_dapo.rewards.served.checkpoint import HEADS, INDEX, SGLANG_VERSION
from megatron_dapo.rewards.served.classifier import load_tokenizer, parse_classify_answer, render_ids
from megatron_dapo.rewards.served.outcome import RewardModelError

PROBES: tuple[tuple[list[dict], str], ...] = (
    ([{"role": "user", "content": "What is 2 + 3?"}], "2 + 3 = 5, so the answer is 5."),
    ([{"role": "user", "content": "Name a prime number larger than 10."}], "Nine is one."),
)
DEFAULT_TOLERANCE = 1e-4
TOLERANCE_BY_DTYPE = {"float32": 1e-4, "float16": 4e-2, "bfloat16": 4e-2}


def served_dtype(model_dir: str | Path, dtype: str) -> str:
    """The precision an SGLang server started with ``--dtype dtype`` computes in: that one, or
    for ``auto`` the checkpoint's ``torch_dtype`` (``dtype`` in newer configs), a float32 one in
    float16 (SGLang's ``auto``: bfloat16 for Gemma)."""
    if dtype != "auto":
        return {"half": "float16", "float": "float32"}.get(dtype, dtype)
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return "bfloat16"  # unknown: the lower precision, the wider tolerance
    stored = str(config.get("torch_dtype") or config.get("dtype") or "float32")
    if stored == "float32":
        return "bfloat16" if "gemma" in str(config.get("model_type", "")) else "float16"
    return stored


def probe_tolerance(model_dir: str | Path, dtype: str, override: float | None = None) -> float:
    """The start-up check's tolerance for a server started with ``--dtype dtype`` on ``model_dir``:
    ``override`` (``reward.model.probe_tolerance``) when given, else by its precision."""
    if override is not None:
        return float(override)
    return TOLERANCE_BY_DTYPE.get(served_dtype(model_dir, dtype), TOLERANCE_BY_DTYPE["bfloat16"])


@dataclass(frozen=True)
class ProbeCheck:
    """What the check compared: per probe, the served score and transformers' (first logit)."""

    server: str
    model: str
    served: tuple[float, ...]
    reference: tuple[float, ...]
    # every logit transformers gave each probe (what a later check of a restart compares with)
    reference_logits: list[list[float]] | None = None

    @property
    def max_abs_diff(self) -> float:
        return max(abs(s - r) for s, r in zip(self.served, self.reference))


def probe_ids(tokenizer, what: str) -> list[list[int]]:
    return [render_ids(tokenizer, messages, response, what) for messages, response in PROBES]


def reference_scores(model_dir: str | Path, ids: list[list[int]]) -> list[list[float]]:
    """transformers' logits for each id list (float32, CPU, one sequence at a time)."""
    import torch
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for row in ids:
            out.append([float(v) for v in model(torch.tensor([row])).logits[0]])
    return out


def served_scores(
    url: str, ids: list[list[int]], timeout_s: float, api_key: str | None = None
) -> list[list[float]]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    out = []
    with httpx.Client(headers=headers, timeout=timeout_s) as http:
        for row in ids:
            try:
                r = http.post(f"{url}/classify", json={"input_ids": row})
            except httpx.HTTPError as e:
                raise RewardModelError(
                    f"reward model start-up check: {url}/classify: {type(e).__name__}: {e}"
                ) from e
            if r.status_code != 200:
                raise RewardModelError(f"reward model start-up check: {http_error(r, 'probe')}")
            values = parse_classify_answer(r.json())
            if values is None:
                raise RewardModelError(
                    f"reward model start-up check: {url}/classify answered no score: {r.text[:200]!r}; "
                    "was the server started with --is-embedding?"
                )
            out.append(values)
    return out


def check_classifier_server(
    url: str,
    model_dir: str | Path,
    *,
    tolerance: float = DEFAULT_TOLERANCE,
    timeout_s: float = 120.0,
    api_key: str | None = None,
    tokenizer=None,
    reference: list[list[float]] | None = None,
) -> ProbeCheck:
    """Compare the server at ``url`` with transformers on ``model_dir`` (the user's checkpoint);
    the comparison, or :class:`RewardModelError` in one line naming the server, the model, both
    scores and the likely cause. ``reference``: transformers' scores of the probes from an earlier
    check (``ProbeCheck.reference_logits``; a restarted server is probed against them, without
    loading the model again)."""
    url = url.rstrip("/")
    what = f"reward model {model_dir}"
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(str(model_dir), what)
    ids = probe_ids(tokenizer, what)
    served = served_scores(url, ids, timeout_s, api_key)
    reference = reference if reference is not None else reference_scores(model_dir, ids)
    if any(len(s) != len(r) for s, r in zip(served, reference)):
        raise RewardModelError(
            f"reward model start-up check: {url} returns {len(served[0])} values per text, transformers' "
            f"model at {model_dir} {len(reference[0])}: the server loads another model"
        )
    check = ProbeCheck(
        url, str(model_dir), tuple(s[0] for s in served), tuple(r[0] for r in reference), reference
    )
    worst = max(abs(a - b) for s, r in zip(served, reference) for a, b in zip(s, r))
    if worst <= tolerance:
        return check
    offsets = [s - r for s, r in zip(check.served, check.reference)]
    raise RewardModelError(
        f"reward model start-up check failed: {url} scores the probes {_fmt(check.served)}, transformers' "
        f"AutoModelForSequenceClassification on {model_dir} {_fmt(check.reference)} (differences "
        f"{_fmt(offsets, sign=True)}, tolerance {tolerance:g}); likely cause: "
        f"{_likely_cause(url, offsets, tolerance, api_key)}"
    )


def _fmt(values, sign: bool = False) -> str:
    return "[" + ", ".join(f"{v:+.6f}" if sign else f"{v:.6f}" for v in values) + "]"


def _likely_cause(url: str, offsets: list[float], tolerance: float, api_key: str | None) -> str:
    constant = max(offsets) - min(offsets) <= tolerance
    served_path, arch = _served_model(url, api_key)
    spec = HEADS.get(arch or "")
    if (
        constant
        and spec is not None
        and spec.zero_bias
        and served_path
        and not _has_tensor(served_path, spec.zero_bias)
    ):
        return (
            f"the server loads {served_path}, which has no {spec.zero_bias}, while SGLang {SGLANG_VERSION}'s "
            f"{arch} ({spec.source}) builds its score head with a bias, left at its random initialisation "
            "(a constant offset that changes with every server start); serve the copy "
            "rewards.served.prepare_served_checkpoint writes, which adds the bias as zeros"
        )
    if constant:
        return (
            f"the same offset on every probe: the server's score head has a bias that the checkpoint at "
            f"{served_path or 'the given path'} does not give it (SGLang's {arch} class against transformers')"
        )
    return (
        f"the scores differ by different amounts: the server loads another checkpoint ({served_path}), "
        "or computes in a lower precision than float32 (its --dtype; raise the tolerance to match it)"
    )


def _served_model(url: str, api_key: str | None) -> tuple[str | None, str | None]:
    """``(model_path, architectures[0])`` the server reports (``GET /model_info``), or Nones."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        info = httpx.get(f"{url}/model_info", headers=headers, timeout=30).json()
        archs = info.get("architectures") or [None]
        return info.get("model_path"), archs[0]
    except (httpx.HTTPError, ValueError, AttributeError):
        return None, None


def _has_tensor(model_dir: str, name: str) -> bool:
    """Whether the checkpoint at ``model_dir`` (read here, if it can be) holds tensor ``name``."""
    path = Path(model_dir)
    index = path / INDEX
    try:
        if index.is_file():
            return name in json.loads(index.read_text())["weight_map"]
        from safetensors import safe_open

        for f in path.glob("*.safetensors"):
            with safe_open(str(f), framework="pt") as st:
                if name in st.keys():  # noqa: SIM118 - safe_open has no __contains__
                    return True
    except (OSError, ValueError, KeyError):
        return True  # unreadable here: do not claim it lacks the tensor
    return False
