"""A tiny Qwen3-MoE (4 experts, top-2, 2 MoE layers; Qwen3's q/k norms and head_dim 24 != 64/4)
through the trainer end to end on CPU: Ray local, 2 Megatron ranks at expert parallel 2 (TP=1,
DP=2, two experts per rank, tokens exchanged all-to-all over gloo), the HF engine running
transformers' Qwen3MoeForCausalLM and recording the experts it routed each token to, rollout
routing replay in the actor (``actor.routing_replay: rollout``), the weight sync with the experts
gathered over EP into HF-named buckets, the DAPO loss.

- At both steps the trainer scores the engine's samples as the engine did (< 1e-4). At step 2 the
  engine serves the weights synced after step 1's update (which moved them: grad norm > 0), so
  this proves the sync of every expert: an expert missing or misplaced in the buckets would
  change the log-probs of the tokens routed to it.
- At both steps the routing-mismatch metric is 0: the trainer's own routers pick the experts the
  engine recorded on every response token and layer (the routers, synced, agree with the engine).

Dense Qwen3 keeps its own coverage: conversion (test_convert_roundtrip), logits and weight-sync
buckets against transformers (test_model_hf_equivalence), config and weight map
(test_qwen3_model)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from e2e_harness import REPO, read_metrics, train_overrides

from megatron_dapo.driver.launch import load_for_cli, run_train


def _qwen3_demo_assets(root: Path) -> dict:
    """The demo's task and tokenizer with a Qwen3-MoE model, briefly warm-started so its responses
    vary in length and correctness (mixed rewards, so the update is not zero)."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from megatron_dapo.demo.model import save_checkpoint
    from megatron_dapo.demo.recipe import DEMO_RECIPE
    from megatron_dapo.demo.sft import SFTConfig, supervised_warm_start
    from megatron_dapo.demo.task import make_problems, to_rows, write_parquet
    from megatron_dapo.demo.tokenizer import build_tokenizer

    spec = DEMO_RECIPE.model
    train, val = make_problems(0, 400, 16)
    write_parquet(to_rows(train, "train"), root / "train.parquet")
    write_parquet(to_rows(val, "test"), root / "val.parquet")
    tokenizer = build_tokenizer(spec.vocab_size)
    config = Qwen3MoeConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        # every layer MoE, as the released Qwen3-MoE models; 4 experts so each EP rank holds 2
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=spec.intermediate_size // 4,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=24,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=False,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        architectures=["Qwen3MoeForCausalLM"],
        dtype="float32",
    )
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config)
    supervised_warm_start(model, tokenizer, train, SFTConfig(steps=30, batch_size=32, seed=0))
    save_checkpoint(model, tokenizer, root / "hf")
    return {"hf": root / "hf", "train": root / "train.parquet", "val": root / "val.parquet"}


@pytest.mark.slow
def test_two_dapo_steps_on_qwen3_moe_at_ep2_with_routing_replay_match_the_engine(tmp_path):
    from transformers import AutoConfig

    assets = _qwen3_demo_assets(tmp_path / "assets")
    files = SimpleNamespace(hf_dir=assets["hf"], train_file=assets["train"], val_file=assets["val"])
    over = {"data.val_max_samples": 4, "algorithm.overlong_buffer.enable": "true", "trainer.test_freq": 0}
    over |= {"trainer.save_freq": 0, "logging.plots_at_end": "false"}
    over |= {
        "parallel.tensor_model_parallel_size": 1,
        "parallel.expert_model_parallel_size": 2,
        "actor.routing_replay": "rollout",
    }
    args = train_overrides(files, tmp_path / "runs", "qwen3_moe", 2, **over)
    cfg = load_for_cli(str(REPO / "configs/demo.yaml"), args)
    assert cfg.parallel.actor_world_size == 2 and cfg.rollout.engine == "hf"
    summary = run_train(cfg)
    run = Path(summary["run_dir"])
    records = read_metrics(run)
    steps = [r for r in records if r["step"] >= 1]
    assert [r["step"] for r in steps] == [1, 2]
    assert steps[0]["actor/grad_norm"] > 0, "the update must change the weights for step 2 to test the sync"
    for r in steps:
        assert r["actor/rollout_logprob_abs_diff"] < 1e-4, (r["step"], r["actor/rollout_logprob_abs_diff"])
        assert r["actor/routing_mismatch"] == 0.0, (r["step"], r["actor/routing_mismatch"])
    exported = json.loads((Path(summary["hf_export"]) / "config.json").read_text())
    assert exported["architectures"] == ["Qwen3MoeForCausalLM"] and exported["head_dim"] == 24
    # transformers 5 writes num_experts as num_local_experts; read it back through its config
    moe = AutoConfig.from_pretrained(summary["hf_export"])
    assert (moe.num_experts, moe.num_experts_per_tok) == (4, 2)
