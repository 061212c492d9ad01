"""The SGLang half of MoE rollout routing replay, which only a GPU can show: SGLang 0.5.23's CPU
server dies at start with ``--enable-return-routed-experts`` (its experts capturer pins a host
buffer through CUDA), so the CPU suite checks the driver against a stand-in with SGLang's reply
layout (tests/test_sglang_routing_replay.py). Here the real server on the GPU returns the experts
of every forwarded position, and they must be the ones transformers' router picks for the same
tokens (top-k of the router logits, per layer and position).

The server and the reference both run bf16 on the GPU with different kernels, so a router near a
tie may pick differently; a reply read at the wrong positions or layers agrees with the reference
about as often as chance (top-2 of 8 experts: ~1/4 of the sets), far below the bound.
"""

from __future__ import annotations

from pathlib import Path

from tools.gpu_checks.runner import CheckFailed, Figure, MissingPiece, check, time_left

AGREEMENT_BOUND = 0.9  # fraction of (position, layer) expert sets equal to the reference's
LAYERS, EXPERTS, TOP_K = 4, 8, 2


def write_tiny_qwen3_moe(path: Path) -> str:
    """A random Qwen3-MoE small enough to start in seconds, bf16 on disk."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    if (path / "config.json").is_file():
        return str(path)
    config = Qwen3MoeConfig(
        vocab_size=4096, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        num_experts=EXPERTS, num_experts_per_tok=TOP_K, norm_topk_prob=True, decoder_sparse_step=1,
        num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        max_position_embeddings=4096, tie_word_embeddings=False, torch_dtype="bfloat16",
        architectures=["Qwen3MoeForCausalLM"],
    )  # fmt: skip
    torch.manual_seed(11)
    model = Qwen3MoeForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(path))
    return str(path)


def reference_experts(hf_dir: str, ids: list[int]):
    """[positions, layers, k] sorted: transformers' router top-k for every position of ``ids``."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16).cuda().eval()
    with torch.no_grad():
        out = model(torch.tensor([ids], device="cuda"), output_router_logits=True)
    per_layer = [logits.float().topk(TOP_K, dim=-1).indices for logits in out.router_logits]
    return torch.stack(per_layer, dim=1).sort(dim=-1).values.cpu()


def agreement(got, ref) -> float:
    """Fraction of (position, layer) whose expert sets are equal."""
    if got.shape != ref.shape:
        raise CheckFailed(f"routed experts of shape {tuple(got.shape)}, expected {tuple(ref.shape)}")
    return float((got.sort(dim=-1).values == ref).all(dim=-1).float().mean())


@check("sglang_routed_experts", needs_cuda=True, budget_s=45, needs=("sglang",))
def sglang_routed_experts(ctx) -> Figure:
    import torch

    from megatron_dapo.ports import free_port
    from megatron_dapo.rollout.types import GenerationRequest, SamplingParams
    from megatron_dapo.sglang.client import SGLangEngine
    from megatron_dapo.sglang.server import (
        SGLangServer,
        SGLangServerConfig,
        check_launchable,
        default_server_python,
    )

    try:
        check_launchable(default_server_python())
    except Exception as e:  # noqa: BLE001 - named as the missing piece
        raise MissingPiece(f"the SGLang server cannot be launched ({e}); use the project's image") from e
    hf_dir = write_tiny_qwen3_moe(ctx.work / "qwen3-moe-tiny")
    prompt = torch.randint(0, 4096, (24,), generator=torch.Generator().manual_seed(5)).tolist()
    cfg = SGLangServerConfig(
        model_path=hf_dir, port=free_port(), mem_fraction_static=0.2, dtype="bfloat16",
        return_routed_experts=True, max_total_tokens=8192, startup_timeout_s=min(300.0, time_left()),
        log_file=str(ctx.work / "sglang_routed_experts.log"),
        extra_args=["--disable-cuda-graph"],  # a correctness check: start in seconds, not capture graphs
    )  # fmt: skip
    with SGLangServer(cfg) as server:
        server.wait_healthy()
        engine = SGLangEngine(
            server.cfg.url, name="moe-0", timeout_s=120.0, routed_experts_shape=(LAYERS, TOP_K)
        )
        request = GenerationRequest(
            "moe-0", prompt, SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
        )
        (result,) = engine.generate([request])
    if result.routed_experts is None:
        raise CheckFailed("the server's reply has no routed_experts although it runs with the flag")
    # the reply covers every forwarded position: the prompt and all generated tokens but the last
    ids = prompt + list(result.output_ids)
    ref = reference_experts(hf_dir, ids)[: len(ids) - 1]
    share = agreement(torch.as_tensor(result.routed_experts).long(), ref)
    values = {"positions": len(ids) - 1, "layers": LAYERS, "agreement": share}
    if share < AGREEMENT_BOUND:
        raise CheckFailed(
            f"the server's routed experts equal transformers' router top-{TOP_K} at {share:.1%} of "
            f"(position, layer) (bound {AGREEMENT_BOUND:.0%}): the reply is read at the wrong positions"
        )
    return Figure(
        f"{share:.1%} of {len(ids) - 1} positions x {LAYERS} layers agree with transformers' router", values
    )
