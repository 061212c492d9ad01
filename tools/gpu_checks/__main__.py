"""``python -m tools.gpu_checks [--dry] [--json PATH] [--work DIR] [--only NAME]`` (from the repo root).

Without ``--only`` it runs every check, each in its own process (tools/gpu_checks/runner.py);
``--only NAME`` is that process: it runs the one check here and writes its result to ``--json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.gpu_checks", description=__doc__)
    ap.add_argument("--dry", action="store_true", help="CPU: tiny shapes, CUDA-only checks reported NOT RUN")
    ap.add_argument("--json", type=Path, default=Path("gpu_check.json"), help="where the figures go")
    ap.add_argument("--work", type=Path, default=None, help="scratch directory (default: a temp dir)")
    ap.add_argument("--only", default=None, help="run this one check in this process (the runner's child)")
    args = ap.parse_args(argv)

    from tools.gpu_checks import checks  # registers the checks
    from tools.gpu_checks.runner import CHECKS, run_checks, run_one_in_this_process

    if args.only is not None:
        by_name = {c.name: c for c in CHECKS}
        if args.only not in by_name:
            print(f"--only {args.only}: no such check; choose one of {', '.join(by_name)}", file=sys.stderr)
            return 2
        result = run_one_in_this_process(by_name[args.only], checks.Context(work=args.work, dry=args.dry))
        args.json.write_text(json.dumps(asdict(result)) + "\n")
        return 0

    with tempfile.TemporaryDirectory(prefix="gpu_checks_") as tmp:
        results = run_checks(args.work or Path(tmp), CHECKS, args.json, args.dry)
    failed = [r.name for r in results if r.status == "FAIL"]
    print(f"figures: {args.json}")
    if failed:
        print(f"FAILED: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
