"""A megatron-core GPTModel built from a Hugging Face config.json (Qwen2/Qwen2.5, Qwen3 dense
and MoE, Llama-3).

The HF config decides the architecture; the parallel layout comes from megatron's parallel_state
(call :func:`megatron_dapo.actor.parallel.init_parallel` first). The Transformer Engine layer spec
is used when TE is importable and a GPU is present, megatron's local spec otherwise, with its core
attention on torch's scaled_dot_product_attention (``actor/sdpa_attention.py``). The vocabulary
is padded to a multiple of ``make_vocab_size_divisible_by * TP`` as megatron requires; logits
beyond ``hf_config.vocab_size`` belong to padding rows (zero when loaded from HF) and must be
ignored by callers (:func:`forward_logits` drops them).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F

from megatron_dapo.actor import compat, gpu_settings
from megatron_dapo.arch import ArchSpec, ModelConfigError, arch_spec, load_hf_config

FP8_FORMATS = ("e4m3", "hybrid")
FP8_RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")


def te_available() -> bool:
    """Transformer Engine importable and a GPU present (the TE spec needs both)."""
    if compat.on_cpu():
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except ImportError:
        return False
    return True


def _check_fp8(fp8: str, fp8_recipe: str) -> None:
    if fp8 not in FP8_FORMATS:
        raise ModelConfigError(f"fp8={fp8!r} is not a valid FP8 format; use one of {FP8_FORMATS}")
    if fp8_recipe not in FP8_RECIPES:
        raise ModelConfigError(f"fp8_recipe={fp8_recipe!r} is not valid; use one of {FP8_RECIPES}")
    capability = None if compat.on_cpu() else tuple(torch.cuda.get_device_capability())
    te_version = gpu_settings.te_version() if te_available() else None
    problem = gpu_settings.fp8_recipe_problem(fp8_recipe, te_version, capability)
    if problem:
        raise ModelConfigError(problem)


def padded_vocab_size(vocab_size: int, tp: int, make_vocab_size_divisible_by: int = 128) -> int:
    """Megatron's padded vocabulary: the next multiple of ``divisible_by * tp``."""
    multiple = make_vocab_size_divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def transformer_config_from_hf(
    hf_config: Any,
    *,
    params_dtype: torch.dtype = torch.float32,
    fp8: str | None = None,
    fp8_recipe: str = "delayed",
    recompute: bool = False,
    sequence_parallel: bool = False,
    tp: int | None = None,
    pp: int | None = None,
    vpp: int | None = None,
    cp: int | None = None,
    perform_initialization: bool = True,
    use_te: bool | None = None,
    **overrides: Any,
) -> Any:
    """A megatron ``TransformerConfig`` equivalent to the HF architecture.

    Parallel sizes default to megatron's initialised parallel_state (1 when it is not set up).
    Dropout is off (RL fine-tuning), fusions that need apex/TE are off on CPU. ``overrides`` are
    passed to TransformerConfig as is (e.g. ``recompute_granularity="selective"``).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_config import TransformerConfig

    hf_config = load_hf_config(hf_config)
    spec = arch_spec(hf_config)
    if fp8 is not None:
        _check_fp8(fp8, fp8_recipe)
    init = ps.model_parallel_is_initialized()
    tp = tp or (ps.get_tensor_model_parallel_world_size() if init else 1)
    pp = pp or (ps.get_pipeline_model_parallel_world_size() if init else 1)
    cp = cp or (ps.get_context_parallel_world_size() if init else 1)
    ep = ps.get_expert_model_parallel_world_size() if init else 1
    if vpp is None and init:
        vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    layers = hf_config.num_hidden_layers
    if layers % (pp * (vpp or 1)):
        raise ModelConfigError(
            f"num_hidden_layers={layers} is not divisible by pp*vpp={pp}*{vpp or 1}; choose another layout"
        )
    heads, kv_heads = (
        hf_config.num_attention_heads,
        hf_config.num_key_value_heads or hf_config.num_attention_heads,
    )
    if heads % tp or kv_heads % tp:
        raise ModelConfigError(
            f"tp={tp} must divide num_attention_heads={heads} and num_key_value_heads={kv_heads}"
        )
    if sequence_parallel and tp == 1:
        sequence_parallel = False
    if spec.num_experts and tp > 1:
        # megatron-core's MoELayer refuses to train with TP > 1 without sequence parallelism (its
        # token dispatchers gather the SP shards of the TP group); forward-only use is equal.
        sequence_parallel = True
    kwargs: dict[str, Any] = dict(
        num_layers=layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=heads,
        num_query_groups=kv_heads,
        kv_channels=spec.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias,
        qk_layernorm=spec.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=getattr(hf_config, "initializer_range", 0.02),
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        pipeline_dtype=params_dtype,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=cp,
        sequence_parallel=sequence_parallel,
        use_cpu_initialization=compat.on_cpu(),
        perform_initialization=perform_initialization,
        attention_softmax_in_fp32=True,
    )
    # Fusions only where their kernels exist (gpu_settings.fusion_flags says which needs what).
    kwargs.update(
        gpu_settings.fusion_flags(
            on_cuda=not compat.on_cpu(),
            use_te=te_available() if use_te is None else use_te and te_available(),
            have_apex=gpu_settings.apex_available(),
        )
    )
    if spec.num_experts:
        if spec.num_experts % ep:
            raise ModelConfigError(
                f"num_experts={spec.num_experts} is not divisible by expert parallel size {ep}; "
                "choose parallel.expert_model_parallel_size dividing it"
            )
        # Expert tensor parallel = TP, megatron-core's own default (ModelParallelConfig and
        # initialize_model_parallel both set expert_tensor_parallel_size = tp when unset): the
        # experts' fc1/fc2 are split over the TP ranks exactly like the dense MLP's, so the
        # weight maps and the TP groups are shared. (ETP=1 would instead fold EP into the TP
        # ranks; it is a layout megatron allows but not its default.)
        kwargs.update(_moe_kwargs(spec), expert_model_parallel_size=ep, expert_tensor_parallel_size=tp)
    if fp8 is not None:
        kwargs.update(fp8=fp8, fp8_recipe=fp8_recipe)
    if recompute:
        kwargs.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def _moe_kwargs(spec: ArchSpec) -> dict[str, Any]:
    """megatron's MoE settings equal to Qwen3-MoE's router: softmax over all experts then top-k
    (``pre_softmax``), or with ``norm_topk_prob`` top-k logits then a softmax over those k, which is
    the renormalised top-k of the full softmax. megatron's own load-balancing loss stays off: the
    actor adds HF's, per sequence and aggregated like the policy loss (actor/moe_aux_loss.py,
    ``actor.moe_aux_loss_coeff``)."""
    return dict(
        num_moe_experts=spec.num_experts,
        moe_router_topk=spec.moe_topk,
        moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
        moe_router_pre_softmax=not spec.norm_topk_prob,
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        # alltoall's dispatcher creates CUDA streams; allgather runs on CPU and is exact at EP=1.
        moe_token_dispatcher_type="allgather",
        moe_grouped_gemm=False,
    ) | _shared_expert_kwargs(spec)


def _shared_expert_kwargs(spec: ArchSpec) -> dict[str, Any]:
    """Qwen2-MoE's shared expert: megatron's SharedExpertMLP with its sigmoid gate
    (``gate_weight`` [1, hidden]) is HF's ``sigmoid(shared_expert_gate(x)) * shared_expert(x)``,
    added to the routed experts' output in both."""
    if not spec.shared_expert_ffn_hidden_size:
        return {}
    return dict(
        moe_shared_expert_intermediate_size=spec.shared_expert_ffn_hidden_size,
        moe_shared_expert_gate=True,
        moe_shared_expert_overlap=False,
    )


def _moe_without_te() -> None:
    """megatron-core 0.16 names TE's fused MoE ops in moe_utils only when TE imports, then tests
    ``te_general_gemm is not None``: without TE the router fails with a NameError. Define them as
    None so the unfused torch path runs."""
    from megatron.core.transformer.moe import moe_utils

    for name in (
        "te_general_gemm",
        "fused_permute",
        "fused_permute_with_probs",
        "fused_unpermute",
        "fused_sort_chunks_by_index",
        "fused_sort_chunks_by_index_with_probs",
        "fused_topk_with_score_function",
        "fused_compute_score_for_moe_aux_loss",
        "fused_moe_aux_loss",
    ):
        if not hasattr(moe_utils, name):
            setattr(moe_utils, name, None)


LOCAL_ATTENTIONS = ("sdpa", "unfused")


def layer_spec(config: Any, use_te: bool | None = None, local_attention: str = "sdpa") -> Any:
    """TE layer spec when ``use_te`` (auto: TE importable and a GPU present), local spec otherwise.

    The local spec's core attention is ``local_attention``: ``"sdpa"``
    (:class:`~megatron_dapo.actor.sdpa_attention.SDPAttention`, memory linear in length, packed
    sequences) or ``"unfused"`` (megatron's ``DotProductAttention``, ``[b, heads, s, s]`` scores,
    no packing), which also serves the configurations SDPA cannot (softmax offsets, sliding
    windows: ``sdpa_attention.sdpa_supports``)."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    from megatron_dapo.actor.sdpa_attention import SDPAttention, sdpa_supports

    if local_attention not in LOCAL_ATTENTIONS:
        raise ModelConfigError(
            f"local_attention={local_attention!r}; choose one of {', '.join(LOCAL_ATTENTIONS)}"
        )

    if use_te is None:
        use_te = te_available()
    if use_te and not te_available():
        raise ModelConfigError("use_te=True but Transformer Engine or a GPU is missing")
    if config.fp8 and not use_te:
        raise ModelConfigError("fp8 needs the Transformer Engine layer spec (use_te)")
    moe = dict(num_experts=config.num_moe_experts, moe_grouped_gemm=False) if config.num_moe_experts else {}
    if moe:
        _moe_without_te()
    if use_te:
        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_layernorm, **moe)
    local = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=config.qk_layernorm, **moe)
    if local_attention == "sdpa" and sdpa_supports(config) is None:
        local.submodules.self_attention.submodules.core_attention = SDPAttention
    elif config.context_parallel_size > 1:
        raise ModelConfigError(
            f"context parallelism without Transformer Engine needs the SDPA attention; "
            f"local_attention={local_attention!r}, {sdpa_supports(config) or 'asked for'}"
        )
    return compat.cpu_context_parallel_spec(local, config)  # CP > 1 on CPU only


def build_gpt_model(
    hf_config: Any,
    *,
    params_dtype: torch.dtype = torch.float32,
    use_te: bool | None = None,
    vpp: int | None = None,
    make_vocab_size_divisible_by: int = 128,
    parallel_output: bool = True,
    config_overrides: dict[str, Any] | None = None,
    local_attention: str = "sdpa",
    **config_kwargs: Any,
) -> list[Any]:
    """This rank's model chunks: one ``GPTModel`` per virtual pipeline stage (one without vpp).

    Needs megatron's parallel_state (``init_parallel``). Each chunk has pre_process on the first
    stage's first virtual chunk and post_process on the last stage's last chunk. Parameters are on
    :func:`compat.device`. ``local_attention``: the local spec's core attention
    (:func:`layer_spec`). ``config_kwargs`` go to :func:`transformer_config_from_hf`.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_model import GPTModel

    compat.apply_cpu_compat()
    hf_config = load_hf_config(hf_config)
    spec = arch_spec(hf_config)
    if vpp is None:
        vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    vpp = vpp if vpp and vpp > 1 else None
    if use_te is None:
        use_te = te_available()
    config = transformer_config_from_hf(
        hf_config,
        params_dtype=params_dtype,
        vpp=vpp,
        use_te=use_te,
        **config_kwargs,
        **(config_overrides or {}),
    )
    transformer_layer_spec = layer_spec(config, use_te, local_attention)
    tp = ps.get_tensor_model_parallel_world_size()
    vocab = padded_vocab_size(hf_config.vocab_size, tp, make_vocab_size_divisible_by)
    pp_rank, pp_size = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
    dev = compat.device()
    chunks = []
    for vp_stage in range(vpp or 1):
        first = pp_rank == 0 and vp_stage == 0
        last = pp_rank == pp_size - 1 and vp_stage == (vpp or 1) - 1
        model = GPTModel(
            config=config,
            transformer_layer_spec=transformer_layer_spec,
            vocab_size=vocab,
            max_sequence_length=getattr(hf_config, "max_position_embeddings", 4096),
            pre_process=first,
            post_process=last,
            parallel_output=parallel_output,
            share_embeddings_and_output_weights=spec.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_base=spec.rope_theta,
            rope_scaling=spec.rope_scaling_factor is not None,
            rope_scaling_factor=spec.rope_scaling_factor or 8.0,
            vp_stage=vp_stage if vpp else None,
        )
        _params_to_dtype(model, params_dtype)
        chunks.append(model.to(dev))
    # The weight maps and logit helpers need the HF side of the model.
    for model in chunks:
        model.hf_config = hf_config
        model.hf_vocab_size = hf_config.vocab_size
    return chunks


def forward_logits(
    model_chunks: list[Any],
    input_ids: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    micro_batch_size: int | None = None,
) -> torch.Tensor | None:
    """Full-vocabulary logits [batch, seq, hf_vocab] of a forward pass through the pipeline.

    Every rank calls it with the same ``input_ids``; the last pipeline stage returns the logits
    (TP-gathered, padding vocab rows dropped), other stages return None. Runs megatron's
    forward-only pipeline schedule, so it exercises the same p2p path as training. The batch is
    split into micro-batches of ``micro_batch_size`` (default: one micro-batch; with virtual
    pipeline stages megatron needs at least PP micro-batches, so the default is then
    batch / PP).
    """
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.pipeline_parallel import get_forward_backward_func

    dev = compat.device()
    input_ids = input_ids.to(dev)
    batch, seq = input_ids.shape
    if position_ids is None:
        position_ids = torch.arange(seq, device=dev).unsqueeze(0).expand(batch, seq)
    position_ids = position_ids.to(dev)
    if micro_batch_size is None:
        pp = ps.get_pipeline_model_parallel_world_size()
        micro_batch_size = batch // pp if len(model_chunks) > 1 else batch
    if micro_batch_size < 1 or batch % micro_batch_size:
        raise ValueError(f"batch {batch} is not divisible into micro-batches of {micro_batch_size}")
    micro_batches = [
        (input_ids[i : i + micro_batch_size], position_ids[i : i + micro_batch_size])
        for i in range(0, batch, micro_batch_size)
    ]
    hf_vocab = getattr(model_chunks[-1], "hf_vocab_size", None)
    collected: list[torch.Tensor] = []

    def forward_step(data_iterator, model):
        ids, pos = next(data_iterator)
        mask = None if attention_mask is None else attention_mask
        out = model(ids, pos, mask)
        post_process = getattr(model, "post_process", True)

        def gather(output):
            if post_process:
                logits = tensor_parallel.gather_from_tensor_model_parallel_region(output)
                collected.append(logits.detach()[..., :hf_vocab] if hf_vocab else logits.detach())
            return output.sum() * 0, {}

        return out, gather

    for model in model_chunks:
        model.eval()
    with torch.no_grad():
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=[iter(micro_batches) for _ in model_chunks]
            if len(model_chunks) > 1
            else iter(micro_batches),
            model=model_chunks if len(model_chunks) > 1 else model_chunks[0],
            num_microbatches=len(micro_batches),
            seq_length=seq,
            micro_batch_size=micro_batch_size,
            forward_only=True,
        )
    if not collected:
        return None
    return torch.cat(collected, dim=0)


def model_parallel_env_summary() -> str:
    """One line naming the backend and layout, for logs."""
    from megatron.core import parallel_state as ps

    return (
        f"backend={compat.dist_backend()} device={compat.device()} "
        f"tp={ps.get_tensor_model_parallel_world_size()} pp={ps.get_pipeline_model_parallel_world_size()} "
        f"dp={ps.get_data_parallel_world_size()} pid={os.getpid()}"
    )


def _params_to_dtype(model: Any, dtype: torch.dtype) -> None:
    """Give every float parameter the model's dtype, as megatron's training loop does with its
    Float16Module wrapper. The local spec's norms (``WrappedTorchNorm``, torch's RMSNorm/LayerNorm)
    ignore ``params_dtype`` and stay fp32; megatron's Float16Optimizer then keeps them apart from
    its bf16 params, and its ``sharded_state_dict`` numbers optimizer states by the bf16 params
    only, so a mixed model cannot save its optimizer (shape mismatch). Parameters only: buffers
    such as RoPE frequencies stay fp32."""
    if dtype == torch.float32:
        return
    for param in model.parameters():
        if param.dtype == torch.float32:
            param.data = param.data.to(dtype)
