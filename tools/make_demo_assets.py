"""Create the `make demo` assets: train/val parquet, tokenizer, warm-started tiny Qwen2 checkpoint.

python tools/make_demo_assets.py --out runs/demo_assets [--seed 0] [--force] [--sft-steps N]
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/demo_assets", help="output directory (reused when up to date)")
    parser.add_argument("--seed", type=int, default=0, help="task, model-init and warm-start seed")
    parser.add_argument("--force", action="store_true", help="rebuild even if cached assets match")
    parser.add_argument(
        "--sft-steps", type=int, default=None, help="override the recipe's most warm-start steps"
    )
    args = parser.parse_args(argv)

    import torch

    from megatron_dapo.demo.assets import prepare_demo_assets
    from megatron_dapo.demo.recipe import DEMO_RECIPE as R

    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    assets = prepare_demo_assets(args.out, seed=args.seed, force=args.force, sft_steps=args.sft_steps)
    print(f"hf checkpoint: {assets.hf_dir}\ntrain: {assets.train_file}\nval:   {assets.val_file}")
    print(
        f"warm start: {assets.sft_steps} steps; initial held-out accuracy (avg@{assets.initial_accuracy_k}, "
        f"T={R.val_temperature}, top_p={R.val_top_p}): {assets.initial_accuracy:.1%}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
