"""The harness of the end-to-end training tests: the demo config's overrides for a tiny run on the
warm-started assets (conftest's ``assets``), the `megatron-dapo train` command, a way to stop a
run at a chosen step on any machine, however loaded, and float64 references to check a run's
metrics against, built from its dumped rollouts and HF transformers."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_dapo.driver.test_hold import HOLD_ENV, RELEASE_ENV

REPO = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, PYTHONUNBUFFERED="1")

# dynamic sampling (unbounded rounds: the batch always fills) and overlong shaping on, as in DAPO
DAPO_ON = {
    "algorithm.filter_groups.enable": "true",
    "algorithm.filter_groups.max_num_gen_batches": 0,
    "algorithm.overlong_buffer.enable": "true",
}


def train_overrides(assets, runs_dir, name, steps, **extra) -> list[str]:
    """Overrides of configs/demo.yaml for a `steps`-step run named `name` on `assets` (anything with
    hf_dir, train_file and val_file), 4 prompts x 4 samples per step; `extra` wins."""
    base = {
        "model.path": assets.hf_dir,
        "data.train_files": f"[{assets.train_file}]",
        "data.val_files": f"[{assets.val_file}]",
        "data.val_max_samples": 6,
        "trainer.runs_dir": runs_dir,
        "trainer.run_name": name,
        "trainer.total_steps": steps,
        "trainer.train_batch_size": 4,
        "rollout.gen_batch_size": 4,
        "rollout.n": 4,
        "rollout.groups_per_call": 4,
        "rollout.val.n": 2,
        "actor.ppo_mini_batch_size": 4,
        "algorithm.filter_groups.enable": "false",
        "algorithm.allow_partial_batch": "false",
        "trainer.test_freq": 2,
        "trainer.save_freq": 1,
        "logging.progress": "false",
        "logging.plots_at_end": "true",
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


DEMO_CONFIG = REPO / "configs" / "demo.yaml"


def train_cmd(args: list[str], config: Path = DEMO_CONFIG) -> list[str]:
    return [sys.executable, "-m", "megatron_dapo.cli", "train", str(config), *args]


def train_to_end(args: list[str], config: Path = DEMO_CONFIG) -> None:
    """Run `megatron-dapo train` with `args` in a subprocess; fail the test if it fails."""
    subprocess.run(
        train_cmd(args, config), check=True, env=ENV, cwd=REPO, stdout=subprocess.DEVNULL, timeout=600
    )


def start_and_wait_for_step(args, metrics: Path, step: int, config: Path = DEMO_CONFIG) -> subprocess.Popen:
    """Start a training run in its own process group; return once `step` is in its metrics.

    The driver is held after `step` (a test-only hook) until a stop signal or `release(run_dir)`,
    so the interruption always lands mid-run however fast or loaded the machine is."""
    hold = {HOLD_ENV: str(step), RELEASE_ENV: str(metrics.parent / "release_hold")}
    proc = subprocess.Popen(
        train_cmd(args, config),
        env=dict(ENV, **hold),
        cwd=REPO,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 400
    while time.monotonic() < deadline:
        if metrics.is_file() and any(r["step"] >= step for r in read_metrics(metrics.parent)):
            return proc
        assert proc.poll() is None, "the run ended before it could be interrupted: " + proc.stderr.read()
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    pytest.fail(f"the run did not reach step {step} in time")


def release(run: Path) -> None:
    """Let a run held by `start_and_wait_for_step` go on."""
    (run / "release_hold").touch()


# ---------------------------------------------------------------- float64 references of a run
# What a run's metrics are checked against, computed without the trainer: the dumped rollouts
# (rollout.dump_rollouts) re-tokenised, HF transformers in float64, the advantages, losses and
# the optimizer's first step written out by hand.


def read_rollouts(run_dir: Path, step: int) -> list[dict]:
    return [
        json.loads(line) for line in (run_dir / "rollouts" / f"step_{step}.jsonl").read_text().splitlines()
    ]


def outcome_advantages(rows: list[dict], estimator: str) -> list[float]:
    """verl's outcome advantages of the dumped responses, from their rewards."""
    groups: dict[int, list[float]] = {}
    for r in rows:
        groups.setdefault(r["group_id"], []).append(r["reward"])
    out = []
    for r in rows:
        g = groups[r["group_id"]]
        mean, n = sum(g) / len(g), len(g)
        if estimator == "grpo":
            std = math.sqrt(sum((x - mean) ** 2 for x in g) / (n - 1))
            out.append((r["reward"] - mean) / (std + 1e-6))
        elif estimator == "rloo":
            out.append(n / (n - 1) * (r["reward"] - mean))
        else:
            out.append(r["reward"] - mean)
    if estimator == "reinforce_plus_plus_baseline":  # whitened over the response tokens
        tokens = [a for a, r in zip(out, rows) for _ in range(r["length"])]
        m = sum(tokens) / len(tokens)
        v = sum((x - m) ** 2 for x in tokens) / (len(tokens) - 1)
        out = [(a - m) / math.sqrt(v + 1e-8) for a in out]
    return out


# The policy losses whose step-1 value, with one mini-batch (pi_old is the current policy, so every
# ratio is exactly 1), follows from the dumped rewards and lengths alone; each runs on an end-to-end
# run whose own checks do not depend on the loss (test_driver_e2e).
GSPO = {"algorithm.policy_loss": "gspo", "algorithm.loss_agg_mode": "seq-mean-token-mean"}
SAPO = {
    "algorithm.policy_loss": "sapo",
    "algorithm.tau_pos": "0.5",
    "algorithm.tau_neg": "2.0",
    "algorithm.entropy_coeff": "0.01",
}


def check_one_update_loss(record: dict, rows: list[dict], loss: str) -> None:
    """``record``: step 1's metrics of a one-mini-batch run with ``GSPO`` or ``SAPO``; ``rows``: its
    dumped rollouts. gspo with seq-mean-token-mean: ``-mean_i A_i`` (its sequence ratio is 1); sapo:
    ``-sum_i A_i (4 / tau_i) sigmoid(0) len_i / N`` (tau_pos for A > 0, tau_neg otherwise), with an
    entropy bonus reported apart (``actor/entropy_loss``)."""
    assert record["step"] == 1 and record["actor/num_updates"] == 1
    assert record["actor/ppo_kl"] == 0.0  # one mini-batch: every ratio is 1
    pg = record["actor/pg_loss"]
    assert math.isfinite(pg) and 0 < record["actor/grad_norm"] < math.inf
    lengths = [r["length"] for r in rows]
    tokens = sum(lengths)
    assert record["actor/tokens"] == tokens
    adv = outcome_advantages(rows, "grpo")
    if loss == "gspo":
        assert pg == pytest.approx(-sum(adv) / len(adv), abs=1e-5)
    else:
        tau_pos, tau_neg = float(SAPO["algorithm.tau_pos"]), float(SAPO["algorithm.tau_neg"])
        gate = [2.0 / (tau_pos if a > 0 else tau_neg) for a in adv]  # 4 / tau * sigmoid(0)
        assert pg == pytest.approx(-sum(a * g * n for a, g, n in zip(adv, gate, lengths)) / tokens, abs=1e-5)
        # token-mean over the one mini-batch: the bonus's entropy is the reported mean entropy
        assert record["actor/entropy_loss"] == pytest.approx(record["actor/entropy"], rel=1e-5)
        assert record["actor/entropy"] > 0


def token_ids(hf_dir, rows: list[dict]) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, response ids) of each dumped sample: the demo's tokenizer has one token per
    character, the prompt was tokenised without special tokens added (it holds the chat
    template's), and a response that stopped ends with EOS, which its decoded text leaves out.
    The tokenizer.json as saved: AutoTokenizer would pick Qwen2's class from config.json, whose
    pre-tokenizer drops the spaces (megatron_dapo/hf_tokenizer.py)."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(str(hf_dir))
    out = []
    for r in rows:
        prompt = tok(r["prompt"], add_special_tokens=False)["input_ids"]
        response = tok(r["response"], add_special_tokens=False)["input_ids"]
        response += [tok.eos_token_id] if r["finish_reason"] == "stop" else []
        assert len(response) == r["length"], (
            f"{r['response']!r} does not re-tokenise to its {r['length']} tokens"
        )
        out.append((prompt, response))
    return out


class Float64Policy:
    """HF transformers' model of an HF checkpoint in float64: response log-probs at temperature 1
    (with a graph), the gradient norm, and the optimizer's first step."""

    def __init__(self, hf_dir):
        import torch
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float64)
        self.params = dict(self.model.named_parameters())

    def logprobs(self, samples: list[tuple[list[int], list[int]]]) -> list:
        """Each (prompt, response)'s response log-probs, from one forward of the right-padded
        batch: under causal attention no token sees the padding after it."""
        import torch

        ids = torch.zeros(len(samples), max(len(p) + len(r) for p, r in samples), dtype=torch.long)
        for row, (prompt, response) in enumerate(samples):
            ids[row, : len(prompt) + len(response)] = torch.tensor(prompt + response)
        logp = torch.log_softmax(self.model(ids).logits, -1)
        return [
            logp[row, len(p) - 1 : len(p) - 1 + len(r)].gather(-1, torch.tensor(r)[:, None]).squeeze(-1)
            for row, (p, r) in enumerate(samples)
        ]

    def grad_norm(self) -> float:
        return math.sqrt(sum(float(p.grad.square().sum()) for p in self.params.values()))

    def first_adamw_step(self, *, lr: float, eps: float, weight_decay: float, clip_grad: float) -> None:
        """megatron's first optimizer step on the gradients in .grad: clipped to ``clip_grad`` by
        the total norm (``clip_grad_by_total_norm_fp32``), then AdamW with decoupled weight decay
        on matrices only (megatron decays neither biases nor norms) and, at Adam's first step,
        ``m_hat = g`` and ``sqrt(v_hat) = |g|``."""
        import torch

        scale = min(1.0, clip_grad / (self.grad_norm() + 1e-6))
        with torch.no_grad():
            for p in self.params.values():
                g = p.grad * scale
                if p.dim() > 1:
                    p.mul_(1 - lr * weight_decay)
                p.sub_(lr * g / (g.abs() + eps))
        self.model.zero_grad()
