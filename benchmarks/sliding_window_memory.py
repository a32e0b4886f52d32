"""Peak resident memory of sliding-window evaluation of one CT-sized volume on CPU.

Builds a tiny 3D segmenter on the ``unet`` backbone, evaluates one random
512 x 512 x 300 volume (16 classes, ROI 96^3, overlap 0.25, the evaluator's
default block budget) with :func:`jascl.evaluation.evaluator.evaluate`, and prints
the process's peak resident set size (``resource.getrusage(...).ru_maxrss``, which
includes building the volume itself) and the wall-clock seconds of the evaluation.

Usage (issue 4 acceptance: peak RSS under 8 GiB)::

    OMP_NUM_THREADS=2 python benchmarks/sliding_window_memory.py

``--size`` / ``--classes`` / ``--roi`` / ``--max-block-elements`` change the setup
(``--max-block-elements 0`` = the unbounded whole-volume pass, for comparison).
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import time

import numpy as np
import torch

from jascl.data.types import Split
from jascl.evaluation.evaluator import MAX_BLOCK_ELEMENTS, evaluate, plan_blocks, window_starts
from jascl.networks.base import create_segmenter


def peak_rss_gib() -> float:
    """Peak resident set size of this process in GiB (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, nargs=3, default=[512, 512, 300])
    parser.add_argument("--classes", type=int, default=16)
    parser.add_argument("--roi", type=int, nargs=3, default=[96, 96, 96])
    parser.add_argument("--overlap", type=float, default=0.25)
    parser.add_argument("--sw-batch-size", type=int, default=4)
    parser.add_argument("--max-block-elements", type=int, default=MAX_BLOCK_ELEMENTS)
    parser.add_argument("--features", type=int, nargs=6, default=[8, 8, 16, 32, 64, 8])
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    budget = args.max_block_elements or None

    model = create_segmenter("unet", spatial_dims=3, in_channels=1, num_classes=args.classes,
                             features=args.features).eval()
    rng = np.random.default_rng(0)
    image = rng.standard_normal((1, 1, *args.size), dtype=np.float32)
    label = rng.integers(0, args.classes, size=(1, *args.size), dtype=np.uint8)
    split = Split(image, label, ["ct"])
    blocks = plan_blocks(args.size, args.roi, args.overlap, args.classes, budget)
    windows = sum(math.prod(sum(1 for s in window_starts(n, r, args.overlap) if src.start <= s <= src.stop - r)
                            for src, n, r in zip(b.source, args.size, args.roi)) for b in blocks)
    whole = math.prod(len(window_starts(n, r, args.overlap)) for n, r in zip(args.size, args.roi))
    print(f"volume {args.size}, {args.classes} classes, roi {args.roi}, overlap {args.overlap}, "
          f"threads {torch.get_num_threads()}, max_block_elements {budget}")
    print(f"blocks {len(blocks)}, window evaluations {windows} (whole-volume pass: {whole})")
    print(f"peak RSS before evaluation: {peak_rss_gib():.2f} GiB")
    started = time.perf_counter()
    result = evaluate(model, [split], list(range(args.classes)), torch.device("cpu"), roi=args.roi,
                      sw_batch_size=args.sw_batch_size, overlap=args.overlap, max_block_elements=budget)
    seconds = time.perf_counter() - started
    print(f"mean Dice over classes 1..{args.classes - 1}: "
          f"{np.nanmean([result.dice[c] for c in range(1, args.classes)]):.4f} (random model, random labels)")
    print(f"peak RSS: {peak_rss_gib():.2f} GiB; evaluation seconds: {seconds:.1f}")


if __name__ == "__main__":
    main()
