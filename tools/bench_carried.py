"""Size and time of the batches an async checkpoint carries: carried.safetensors vs the old form.

Before carried.safetensors the batches travelled as dataclass dicts (`asdict`) in the trainer
state: sent to every rank with the save call and pickled into the checkpoint's common.pt
(JSON-able, and some tools dumped them as JSON). This builds one batch of ``--samples``
responses of ``--tokens`` tokens each (random token ids and log-probs, 200-token prompts, 4 bytes
of text per token, one weight version per token), writes and reads it both ways, checks the round
trip, and prints the sizes and seconds.

    python tools/bench_carried.py [--samples 512] [--tokens 4096]

Not a test; the seconds move with the machine's load.
"""

from __future__ import annotations

import argparse
import json
import pickle
import random
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from megatron_dapo.data.types import PromptSample
from megatron_dapo.driver.run_state import queue_from_state, read_carried, write_carried
from megatron_dapo.rollout.types import RolloutBatch, RolloutSample


def make_batch(samples: int, tokens: int, seed: int = 0) -> RolloutBatch:
    rng = random.Random(seed)
    rows = []
    for i in range(samples):
        prompt = PromptSample(
            i,
            "math_dapo",
            [{"role": "user", "content": "x" * 400}],
            "x" * 400,
            [rng.randrange(150_000) for _ in range(200)],
            "1",
        )
        rows.append(
            RolloutSample(
                group_id=i // 16,
                prompt=prompt,
                response_ids=[rng.randrange(150_000) for _ in range(tokens)],
                rollout_logprobs=[-rng.random() * 5 for _ in range(tokens)],
                response_text="y" * (4 * tokens),
                finish_reason="stop",
                score=1.0,
                acc=True,
                pred="1",
                overlong_penalty=0.0,
                final_reward=1.0,
                weight_version=3,
                truncated=False,
                token_versions=[3] * tokens,
            )
        )
    return RolloutBatch(rows, {"rollout/prompts_drawn": float(samples)})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=4096)
    args = ap.parse_args()
    batch = make_batch(args.samples, args.tokens)
    out = Path(tempfile.mkdtemp(prefix="bench_carried_"))

    t = time.perf_counter()
    old = {"batches": [{"samples": [asdict(s) for s in batch.samples], "metrics": batch.metrics}]}
    blob = pickle.dumps(old, protocol=2)  # torch.save's pickle protocol for common.pt
    t_old_write = time.perf_counter() - t
    t = time.perf_counter()
    assert queue_from_state(pickle.loads(blob)) == [batch]
    t_old_read = time.perf_counter() - t
    as_json = len(json.dumps(old))

    t = time.perf_counter()
    size = write_carried(out / "carried.safetensors", [batch])
    t_write = time.perf_counter() - t
    t = time.perf_counter()
    assert read_carried(out / "carried.safetensors") == [batch]
    t_read = time.perf_counter() - t
    (out / "carried.safetensors").unlink()
    out.rmdir()

    print(f"{args.samples} samples x {args.tokens} tokens")
    print(
        f"  old form (asdict in the trainer state): pickled {len(blob) / 1e6:.0f} MB, "
        f"asdict+pickle {t_old_write:.1f} s, unpickle+rebuild {t_old_read:.1f} s; as JSON {as_json / 1e6:.0f} MB"
    )
    print(f"  carried.safetensors: {size / 1e6:.0f} MB, write {t_write:.1f} s, read {t_read:.1f} s")


if __name__ == "__main__":
    main()
