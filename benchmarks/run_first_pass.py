"""A run's first pass on a cold store, with and without ``prepare_workers`` (issue 33), one setting per process.

Writes (once, kept in ``--dir``) the CT-like MSD dataset of :mod:`data_pipeline` and times what a run does before
and while it reads its samples the first time: :func:`jascl.data.sessions.load_sessions` (selection, label index,
and with ``--prepare-workers`` other than 0 the parallel fill of the store), then one read of every sample of every
split, as training and evaluation would read them (whole samples, the evaluation path). Each call starts from an
empty cache and is its own process, so each pays the same start-up::

    python benchmarks/run_first_pass.py --prepare-workers 0     # each sample on first access, one after another
    python benchmarks/run_first_pass.py --prepare-workers -1    # the default: the store filled in parallel first

Prints seconds per sample for the two stages and in all.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import data_pipeline  # noqa: E402

from jascl.data.sessions import load_sessions  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prepare-workers", type=int, default=-1)
    parser.add_argument("--cases", type=int, default=16, help="volumes (a run fills in parallel from 16 missing)")
    parser.add_argument("--shape", type=int, nargs=3, default=(256, 256, 150))
    parser.add_argument("--dir", default="run-first-pass-data", help="dataset folder, written once and kept")
    args = parser.parse_args()
    base = Path(args.dir)
    root = data_pipeline.kept_dataset(base, args.cases, tuple(args.shape))
    cache = base / f"cache-{args.prepare_workers}"
    shutil.rmtree(cache, ignore_errors=True)
    start = time.perf_counter()
    data = load_sessions(
        data_pipeline.protocol_for(args.cases),
        cache,
        lambda m: None,
        {"bench": root},
        prepare_workers=args.prepare_workers,
    )
    loaded = time.perf_counter()
    samples = 0
    for session in data:
        for split in (session.train, session.test):
            for i in range(len(split)):
                split.images[i]
                samples += 1
    done = time.perf_counter()
    shutil.rmtree(cache, ignore_errors=True)
    print(
        f"prepare_workers {args.prepare_workers}: {samples} samples; load_sessions {loaded - start:.1f} s, first reads "
        f"{done - loaded:.1f} s, in all {(done - start) / samples:.2f} s per sample ({done - start:.1f} s)"
    )


if __name__ == "__main__":
    main()
