"""Reward worker process: scores requests from :class:`~megatron_dapo.rewards.scorer.Scorer`.

Run as ``python -m megatron_dapo.rewards.worker [--custom-fn SPEC] [--boxed-fallback]``.
Protocol (one JSON object per line): the worker first writes ``{"ready": true}`` or
``{"ready": false, "error": ...}``; then, for each request line ``{"items": [[data_source,
solution_str, ground_truth, extra_info], ...]}``, it writes one result line per item, in order,
as soon as that item is done: ``{"score", "acc", "pred"}`` or ``{"error": "Type: message (at
FILE:LINE in FUNCTION)"}``, the place in the custom reward's file where it raised.

The protocol uses a private duplicate of stdout; fd 1 is pointed at stderr so that a reward
function that prints cannot corrupt the stream.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

from megatron_dapo.rewards.registry import builtin_reward, load_custom_fn, reward_fields


def _score_one(item, custom_fn, boxed_fallback: bool, custom_file: str | None = None) -> dict:
    data_source, solution_str, ground_truth, extra_info = item
    try:
        if custom_fn is not None:
            value = custom_fn(data_source, solution_str, ground_truth, extra_info)
        else:
            value = builtin_reward(data_source, boxed_fallback)(solution_str, ground_truth, extra_info)
        score, acc, pred = reward_fields(value)
    except Exception as e:  # a broken reward must score the sample as wrong, not end the worker
        return {"error": f"{type(e).__name__}: {e} ({_where(e, custom_file)})"}
    return {"score": score, "acc": acc, "pred": pred}


def _where(e: BaseException, custom_file: str | None) -> str:
    """Where it was raised, as ``at FILE:LINE in FUNCTION``: the deepest frame of the custom
    reward's own file (the line its author must fix), else the deepest frame of all."""
    frames = traceback.extract_tb(e.__traceback__)
    own = [f for f in frames if custom_file and os.path.abspath(f.filename) == custom_file]
    frame = (own or frames)[-1]
    return f"at {frame.filename}:{frame.lineno} in {frame.name}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--custom-fn", default=None)
    parser.add_argument("--boxed-fallback", action="store_true")
    args = parser.parse_args(argv)
    # a signal to the whole process group (Slurm's SIGTERM, Ctrl-C) is the driver's to handle:
    # it still needs rewards while it finishes, and it ends this worker by closing its input
    import signal

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)

    protocol = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def send(obj: dict) -> None:
        protocol.write(json.dumps(obj) + "\n")
        protocol.flush()

    custom_fn = None
    custom_file = os.path.abspath(args.custom_fn.rpartition(":")[0]) if args.custom_fn else None
    if args.custom_fn:
        try:
            custom_fn = load_custom_fn(args.custom_fn)
        except Exception as e:
            send({"ready": False, "error": f"{type(e).__name__}: {e}"})
            return 1
    send({"ready": True})

    for line in sys.stdin:
        request = json.loads(line)
        for item in request["items"]:
            send(_score_one(item, custom_fn, args.boxed_fallback, custom_file))
    return 0


if __name__ == "__main__":
    sys.exit(main())
