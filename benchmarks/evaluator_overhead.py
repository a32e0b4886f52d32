"""jascl's evaluator against a plain sliding-window loop, alternating in one process (less noise than ``jascl bench``).

``jascl bench``'s ``eval`` and ``eval-plain`` cases run in processes of their own, a few passes each, and on a
small shared CPU their rounds spread by a third or more. This script builds the same model and test splits
(``bench-2d`` session 1 by default, the bench's own set-up), then times a pass of each loop alternately
``--repeats`` times after one warm-up pass each, and prints each loop's best and median milliseconds per sample
and the throughput ratios of the best and of the median passes (target >= 0.95, as in ``jascl bench``).

Usage::

    python benchmarks/evaluator_overhead.py [--protocol bench-2d] [--repeats 30] [--threads 1]
    PYTHONPATH=<another checkout>/src python benchmarks/evaluator_overhead.py   # the same for other code
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--protocol", default="bench-2d")
    parser.add_argument("--session", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    from monai.inferers import sliding_window_inference

    from jascl.evaluation.evaluator import evaluate
    from jascl.experiments import bench_cases

    spec = {
        "protocol": args.protocol, "session": args.session, "epochs": 2, "overrides": ["device=cpu"],
        "device": "cpu", "cache_dir": None, "eval_repeats": 1, "threads": args.threads,
    }  # fmt: skip
    protocol, config, data, _, model, t = bench_cases._grown_model(spec)
    model.eval()
    splits = [d.test for d in data[: t + 1]]
    spatial = splits[0].images.shape[2:]
    roi = list(config.patch_size) if config.patch_size else [max(s // 2, 1) for s in spatial]
    samples = sum(len(s) for s in splits)
    device = torch.device("cpu")

    def jascl_evaluator() -> None:
        evaluate(
            model, splits, protocol.seen_classes(t), device, roi=roi, sw_batch_size=config.sw_batch_size,
            overlap=config.sw_overlap,
        )  # fmt: skip

    @torch.no_grad()
    def plain_loop() -> None:  # what jascl bench's eval-plain case times
        for split in splits:
            for i in range(len(split)):
                x = torch.from_numpy(split.images[i][None]).float()
                sliding_window_inference(x, roi, config.sw_batch_size, model, overlap=config.sw_overlap).argmax(1)

    loops = {"eval": jascl_evaluator, "eval-plain": plain_loop}
    times: dict[str, list[float]] = {name: [] for name in loops}
    for loop in loops.values():
        loop()  # warm-up
    for _ in range(args.repeats):
        for name, loop in loops.items():
            start = time.perf_counter()
            loop()
            times[name].append((time.perf_counter() - start) / samples * 1000)
    for name, ms in times.items():
        print(f"{name}: {min(ms):.2f} ms/sample best, {statistics.median(ms):.2f} median ({samples} samples)")
    best = min(times["eval-plain"]) / min(times["eval"])
    median = statistics.median(times["eval-plain"]) / statistics.median(times["eval"])
    print(f"eval / eval-plain (throughput): {best:.3f} of the best passes, {median:.3f} of the medians")


if __name__ == "__main__":
    main()
