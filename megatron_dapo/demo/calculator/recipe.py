"""The calculator demo's recipe: task size, warm start and the RL values configs/demo_calculator.yaml
holds (the measured curves are in the README).

The task: "Compute 347 * 48." The tiny model (the arithmetic demo's shape) cannot multiply; it can
call the calculator ("[347 * 48]"), read its answer ("<|tool|>16656") and copy it ("Answer: 16656").
The warm start's lazy teacher calls the tool in ``sft_tool_rate`` of the examples and guesses in the
others, so the warm-started policy copies well but calls only that often; DAPO, rewarded on the
final answer, has to make it call every time. Evaluation: the project's protocol (avg@4 at
temperature 1.0, top_p 0.7, on 200 held-out problems), the episodes run with the tool.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_dapo.demo.model import TinyModelSpec


@dataclass(frozen=True)
class CalculatorRecipe:
    model: TinyModelSpec = field(default_factory=TinyModelSpec)
    num_train: int = 4000
    num_val: int = 200
    # Warm start: a lazy teacher, until the greedy call and the greedy copy of the tool's answer
    # are both right on sft_stop_accuracy of the probe (training problems, the call forced).
    sft_steps: int = 2000  # at most
    sft_stop_accuracy: float = 0.9
    sft_min_steps: int = 0
    sft_check_every: int = 50
    sft_probe_problems: int = 200
    sft_batch_size: int = 64
    sft_lr: float = 3e-3
    # Share of the teacher's examples that call the tool. Above 0.3 so that the call stays inside
    # the evaluation's top_p=0.7 nucleus (at 0.3 the other first token alone fills it).
    sft_tool_rate: float = 0.4
    # Episodes (rollout.multi_turn and data.*): a calling episode is 32 response tokens (call 11,
    # tool answer 7, reply 14), a direct answer 14; the prompt is 31 with the tool list.
    max_prompt_length: int = 32
    max_response_length: int = 40
    max_assistant_turns: int = 2
    max_turn_tokens: int = 16
    # Evaluation protocol.
    val_k: int = 4
    val_temperature: float = 1.0
    val_top_p: float = 0.7
    val_seed: int = 1234


CALCULATOR_RECIPE = CalculatorRecipe()
