"""``python -m tools.gpu_checks [--dry] [--json PATH] [--work DIR]`` (from the repo root)."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.gpu_checks", description=__doc__)
    ap.add_argument("--dry", action="store_true", help="CPU: tiny shapes, CUDA-only checks reported NOT RUN")
    ap.add_argument("--json", type=Path, default=Path("gpu_check.json"), help="where the figures go")
    ap.add_argument("--work", type=Path, default=None, help="scratch directory (default: a temp dir)")
    args = ap.parse_args(argv)

    from tools.gpu_checks import checks  # registers the checks
    from tools.gpu_checks.runner import CHECKS, run_checks

    with tempfile.TemporaryDirectory(prefix="gpu_checks_") as tmp:
        ctx = checks.Context(work=args.work or Path(tmp), dry=args.dry)
        results = run_checks(ctx, CHECKS, args.json, args.dry)
    failed = [r.name for r in results if r.status == "FAIL"]
    print(f"figures: {args.json}")
    if failed:
        print(f"FAILED at {failed[0]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
