"""Resource planner: parameters, per-GPU memory, fits-or-fix, tokens and time per DAPO step.

Pure Python (no torch) so `megatron-dapo plan` runs anywhere, before a cluster is booked.
"""

from megatron_dapo.plan.gpus import GPUS, gpu_for
from megatron_dapo.plan.inputs import Assumptions, PlanInputs, inputs_from_config
from megatron_dapo.plan.models import QWEN2_5, QWEN3, ModelShape, resolve_model_shape, shape_from_hf_config
from megatron_dapo.plan.params import count_params, padded_vocab, params_per_gpu
from megatron_dapo.plan.planner import Plan, make_plan, plan_from_config

__all__ = [
    "GPUS",
    "QWEN2_5",
    "QWEN3",
    "Assumptions",
    "ModelShape",
    "Plan",
    "PlanInputs",
    "count_params",
    "gpu_for",
    "inputs_from_config",
    "make_plan",
    "padded_vocab",
    "params_per_gpu",
    "plan_from_config",
    "resolve_model_shape",
    "shape_from_hf_config",
]
