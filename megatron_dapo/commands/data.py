"""`megatron-dapo data prepare NAME --out DIR`: the recipes' data files, in verl's parquet layout."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megatron_dapo.data.prepare import DATASETS, prepare
from megatron_dapo.data.types import DataError


def register(p: argparse.ArgumentParser) -> None:
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    prep = actions.add_parser(
        "prepare",
        help="write a data set the recipes name as verl parquet (DAPO template applied, checked)",
        description=(
            "Write DIR/<file> for NAME in verl's layout (data_source math_dapo, the DAPO template, "
            "reward_model.ground_truth), from the Hugging Face hub (its cache; HF_HUB_OFFLINE=1 reads "
            "only the cache) or from a local copy (--from). Row counts and checksums are checked; "
            "DIR/<file>.json records them."
        ),
    )
    prep.add_argument("name", choices=sorted(DATASETS), help="the data set")
    prep.add_argument("--out", required=True, help="output directory (the recipes read data/)")
    prep.add_argument("--from", dest="source", default=None, help="a local parquet copy instead of the hub")
    prep.add_argument("--revision", default=None, help="hub revision (commit, tag or branch) to pin")
    prep.set_defaults(func=run_prepare)


def run_prepare(args: argparse.Namespace) -> int:
    try:
        done = prepare(args.name, Path(args.out), Path(args.source) if args.source else None, args.revision)
    except DataError as e:
        print(f"data error: {e}", file=sys.stderr)
        return 2
    verb = "already prepared" if done.reused else "wrote"
    print(f"{verb} {done.path}: {done.rows} rows, sha256 {done.sha256} (from {done.source})")
    return 0
