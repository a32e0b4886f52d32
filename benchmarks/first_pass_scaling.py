"""How ``jascl data prepare``'s first pass scales with ``--workers`` (issue 33, item 3), one setting per process.

Writes (once, kept in ``--dir``) the CT-like MSD dataset of :mod:`data_pipeline` and times
:func:`jascl.data.prepare.prepare_protocol` into an empty cache with ``--workers N``. Each call is its own
process, so every setting pays the same start-up (the fork server importing torch and MONAI), and a setting can
be pinned to cores from outside. A worker gets ``cores // workers`` torch threads, so one worker on two cores
already runs MONAI's resampling on two threads; pinning it to one core times a one-thread worker::

    python benchmarks/first_pass_scaling.py --workers 1                 # one worker, all cores' threads
    taskset -c 0 python benchmarks/first_pass_scaling.py --workers 1    # one one-thread worker
    python benchmarks/first_pass_scaling.py --workers 2                 # two one-thread workers on two cores

Prints seconds per volume and the workers' peak RSS.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import data_pipeline  # noqa: E402

from jascl.data.prepare import prepare_protocol  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--cases", type=int, default=4)
    parser.add_argument("--shape", type=int, nargs=3, default=(512, 512, 300))
    parser.add_argument("--dir", default="first-pass-data", help="dataset folder, written once and kept")
    args = parser.parse_args()
    base = Path(args.dir)
    root = data_pipeline.kept_dataset(base, args.cases, tuple(args.shape))
    cache = base / f"cache-{args.workers}"
    shutil.rmtree(cache, ignore_errors=True)
    start = time.perf_counter()
    report = prepare_protocol(
        data_pipeline.protocol_for(args.cases),
        {"bench": root},
        cache_dir=cache,
        workers=args.workers,
        echo=lambda *a: None,
        progress=False,
    )
    wall = time.perf_counter() - start
    shutil.rmtree(cache, ignore_errors=True)
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    print(
        f"workers {args.workers} on cores {sorted(cpus) if cpus else '?'}: {report.seconds / args.cases:.2f} s per volume "
        f"({wall:.1f} s for {report.built} volumes, start-up included); worker peak RSS "
        f"{report.worker_peak_rss_mib:.0f} MiB"
    )


if __name__ == "__main__":
    main()
