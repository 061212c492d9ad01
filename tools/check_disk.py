"""Stop `make setup` with one line when the disk cannot hold what it is about to install.

pip's own failure on a full disk is an OSError in the middle of an install, after minutes, leaving a
half-built venv; this check runs first. Standard library only: it runs before any venv exists.
"""

import argparse
import os
import shutil
import sys


def shortfalls(paths: list[str], need_mb: int) -> list[str]:
    """One message per filesystem (checked once however many paths sit on it) with under need_mb free."""
    seen, out = set(), []
    for path in paths:
        if not os.path.isdir(path):
            continue
        dev = os.stat(path).st_dev
        if dev in seen:
            continue
        seen.add(dev)
        free_mb = shutil.disk_usage(path).free // 2**20
        if free_mb < need_mb:
            out.append(f"{free_mb} MB free on the disk holding {os.path.abspath(path)}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--need-mb", type=int, required=True)
    ap.add_argument("--what", required=True, help="what is being installed, for the message")
    ap.add_argument("paths", nargs="+", help="folders whose disks must have room (the repo, TMPDIR)")
    args = ap.parse_args(argv)
    short = shortfalls(args.paths, args.need_mb)
    if short:
        print(
            f"make: {args.what} needs about {args.need_mb} MB free, but only {'; '.join(short)}. "
            "Free some space (old .venv* folders, ~/.cache/pip, ~/.cache/uv, /tmp/ray) or point TMPDIR at a larger disk, then rerun.",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
