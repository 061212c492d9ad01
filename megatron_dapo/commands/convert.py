"""`megatron-dapo convert hf-to-megatron|megatron-to-hf`: checkpoint conversion (also tools/convert_*.py)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from megatron_dapo import notices
from megatron_dapo.convert import hf_to_megatron, megatron_to_hf


def add_hf_to_megatron_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hf-dir", required=True, help="HF model directory (config.json + safetensors)")
    p.add_argument("--megatron-dir", required=True, help="output Megatron dist checkpoint directory")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size to write (default 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline parallel size to write (default 1)")
    p.add_argument("--vpp", type=int, default=None, help="virtual pipeline stages per PP rank")
    p.add_argument("--ep", type=int, default=1, help="MoE expert parallel size to write (default 1)")
    p.add_argument("--dtype", default="auto", help="auto (the HF config's), float32, bfloat16, float16")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def add_megatron_to_hf_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--megatron-dir", required=True, help="Megatron dist checkpoint (converter or trainer)")
    p.add_argument("--hf-dir", required=True, help="output HF model directory")
    p.add_argument(
        "--hf-config-dir",
        default=None,
        help="HF config + tokenizer source (default: the copies in --megatron-dir)",
    )
    p.add_argument("--dtype", default="auto", help="auto (the checkpoint's), float32, bfloat16, float16")
    p.add_argument("--max-shard-size-gb", type=float, default=5.0, help="safetensors shard size (default 5)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def register(p: argparse.ArgumentParser) -> None:
    directions = p.add_subparsers(dest="direction", metavar="DIRECTION", required=True)
    h2m = directions.add_parser(
        "hf-to-megatron", help="HF safetensors -> Megatron dist checkpoint (any TP/PP)"
    )
    add_hf_to_megatron_args(h2m)
    h2m.set_defaults(func=run_hf_to_megatron)
    m2h = directions.add_parser(
        "megatron-to-hf", help="Megatron dist checkpoint (any layout) -> HF safetensors"
    )
    add_megatron_to_hf_args(m2h)
    m2h.set_defaults(func=run_megatron_to_hf)


def _report_errors(out_key: str):
    def wrap(fn):
        def run(args: argparse.Namespace) -> int:
            before = os.environ.get(notices.LOG_ENV)
            log = _route_cpu_notices(Path(getattr(args, out_key)))
            try:
                # failures (also those of the spawned ranks) become one line in megatron_dapo.cli
                out = fn(args)
            finally:
                if before is None:
                    os.environ.pop(notices.LOG_ENV, None)
                else:
                    os.environ[notices.LOG_ENV] = before
            print(f"wrote {out}")
            if log is not None and log.is_file():
                print(f"megatron-core's CPU notices (Transformer Engine and Apex absent, ...): {log}")
            return 0

        return run

    return wrap


def _route_cpu_notices(out: Path) -> Path | None:
    """On a machine without CUDA, megatron-core's known notices (its local fallbacks for Transformer
    Engine and Apex, ...) go to ``OUT.warnings.log`` beside the output, in this process and in the
    ranks it starts (they read ``LOG_ENV``), as a run's go to its warnings.log. On GPUs: nothing."""
    import torch

    if torch.cuda.is_available():
        return None
    log = out.parent / f"{out.name}.{notices.LOG_NAME}"
    os.environ[notices.LOG_ENV] = str(log)
    notices.route_warnings(log)
    return log


@_report_errors("megatron_dir")
def _hf_to_megatron(args: argparse.Namespace):
    return hf_to_megatron(
        args.hf_dir,
        args.megatron_dir,
        tp=args.tp,
        pp=args.pp,
        vpp=args.vpp,
        ep=args.ep,
        dtype=args.dtype,
        overwrite=args.overwrite,
        progress=not args.no_progress,
    )


@_report_errors("hf_dir")
def _megatron_to_hf(args: argparse.Namespace):
    return megatron_to_hf(
        args.megatron_dir,
        args.hf_dir,
        hf_config_dir=args.hf_config_dir,
        dtype=args.dtype,
        overwrite=args.overwrite,
        max_shard_bytes=int(args.max_shard_size_gb * (1 << 30)),
        progress=not args.no_progress,
    )


def run_hf_to_megatron(args: argparse.Namespace) -> int:
    return _hf_to_megatron(args)


def run_megatron_to_hf(args: argparse.Namespace) -> int:
    return _megatron_to_hf(args)
