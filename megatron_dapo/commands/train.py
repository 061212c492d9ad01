"""`megatron-dapo train CONFIG [key=value ...]`: run DAPO (Ray driver)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from megatron_dapo.config import ConfigError
from megatron_dapo.data.types import DataError
from megatron_dapo.driver.launch import load_for_cli, run_train
from megatron_dapo.errors import set_log_dir


def register(p: argparse.ArgumentParser) -> None:
    p.description = "Run DAPO as configured. Under torchrun use `python -m megatron_dapo.train`."
    p.add_argument("config", help="YAML recipe, e.g. configs/dapo_qwen2.5_7b.yaml")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. trainer.total_steps=10")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        cfg = load_for_cli(args.config, list(args.overrides))
        set_log_dir(Path(cfg.trainer.runs_dir) / cfg.trainer.run_name)  # a failure's traceback goes there
        summary = run_train(cfg)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except DataError as e:
        print(f"data error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({k: summary.get(k) for k in ("run_dir", "step", "stopped_by", "hf_export")}, indent=2))
    return 0
