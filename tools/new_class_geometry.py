"""Print why a session's new classes were (not) learned: prototype cosines and where their test pixels went.

usage: python tools/new_class_geometry.py RUN_DIR METHOD SESSION [--start FOLDER] [--cache-dir DIR]

See :mod:`jascl.results.geometry` (docs/method.md, "New classes under prototype replay").
"""

from __future__ import annotations

import argparse
import sys

from jascl.errors import JasclError
from jascl.results.geometry import new_class_geometry


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", help="a finished run folder (jascl run --out)")
    parser.add_argument("method", help="a method of that run, e.g. jascl")
    parser.add_argument("session", type=int, help="an incremental session index (1, 2, ...)")
    parser.add_argument("--start", help="the session folder the session started from (default: found in the run)")
    parser.add_argument("--cache-dir", help="where the run's synthetic data is cached")
    args = parser.parse_args(argv)
    try:
        geometry = new_class_geometry(args.run, args.method, args.session, args.cache_dir, args.start)
    except JasclError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(geometry.to_markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
