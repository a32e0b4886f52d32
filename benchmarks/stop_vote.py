"""What the ranks' stop vote (:class:`jascl.engine.stop.StopVote`) costs a training step.

Two processes in a gloo group (forked from this one), each calling ``after_step`` after every stand-in step (a
busy loop of ``--step-ms``: the CPU is busy as in a step, so the vote's gloo thread competes for it), ``--steps``
times; prints each rank's mean, median and 99th-percentile time of the call.

Usage::

    python benchmarks/stop_vote.py
    python benchmarks/stop_vote.py --step-ms 50 --steps 500
"""

from __future__ import annotations

import argparse
import multiprocessing
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from jascl import distributed
from jascl.engine.stop import StopVote


def rank_main(rank: int, store: str, results, step_s: float, steps: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        vote = StopVote()
        vote.after_step()  # (the first call posts and reads nothing)
        times = []
        for _ in range(steps):
            end = time.perf_counter() + step_s
            while time.perf_counter() < end:
                pass
            t0 = time.perf_counter()
            vote.after_step()
            times.append(time.perf_counter() - t0)
        times.sort()
        us = [1e6 * t for t in (sum(times) / len(times), times[len(times) // 2], times[int(0.99 * len(times))])]
        results.put((rank, *us))
    finally:
        distributed.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--step-ms", type=float, default=5.0, help="the stand-in step's length")
    parser.add_argument("--steps", type=int, default=2000)
    args = parser.parse_args()
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = str(Path(tmp) / "store")
        ranks = [
            context.Process(target=rank_main, args=(r, store, results, args.step_ms / 1000, args.steps)) for r in (0, 1)
        ]
        for p in ranks:
            p.start()
        rows = sorted(results.get(timeout=600) for _ in ranks)
        for p in ranks:
            p.join()
    print(f"| rank | after_step mean (us) | median (us) | 99th percentile (us) |  ({args.step_ms:g} ms steps)")
    print("|---|---|---|---|")
    for rank, mean, median, p99 in rows:
        print(f"| {rank} | {mean:.0f} | {median:.0f} | {p99:.0f} |")


if __name__ == "__main__":
    main()
