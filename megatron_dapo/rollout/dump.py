"""The rollout dump: one JSON line per trained sample (``rollout.dump_rollouts``)."""

from __future__ import annotations

import json
from pathlib import Path

from megatron_dapo.rollout.types import RolloutBatch


def dump_rollouts(batch: RolloutBatch, path: str | Path) -> Path:
    """Write one JSON line per sample (prompt, response, reward, acc, length, ...) to ``path``.

    The driver calls it with ``run_dir / "rollouts" / f"step_{step}.jsonl"``.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for s in batch.samples:
            row = {
                "group_id": s.group_id,
                "prompt_index": s.prompt.index,
                "data_source": s.prompt.data_source,
                "prompt": s.prompt.prompt_text,
                "response": s.response_text,
                "ground_truth": s.prompt.ground_truth,
                "pred": s.pred,
                "score": s.score,
                "acc": s.acc,
                "overlong_penalty": s.overlong_penalty,
                "reward": s.final_reward,
                "length": s.response_length,
                "finish_reason": s.finish_reason,
                "weight_version": s.weight_version,
            }
            if s.model_score is not None or s.unscored is not None:  # reward.model
                row.update(unscored=s.unscored, rule_score=s.rule_score, model_score=s.model_score)
            if s.episode is not None:  # multi-turn: the turns (role, token span) and why it ended
                row["episode"] = s.episode
                row["sampled_tokens"] = s.sampled_length
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path
