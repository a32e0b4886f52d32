"""Peak memory of one whole-volume forward of a 3D backbone's features (what a prototype pass would cost without
sliding windows: ``jascl.engine.tasks.segmentation.accumulate_prototypes``).

Runs ``forward_features`` under ``torch.no_grad()`` on one random volume per size, smallest first, on the CPU, and
prints the process's peak RSS after each (the peak only grows, so each row's growth is that size's extra need).

Usage::

    python benchmarks/whole_volume_memory.py
    python benchmarks/whole_volume_memory.py --backbone unet3d-authors --sizes 96,128,160 --classes 16
"""

from __future__ import annotations

import argparse
import resource
import time

import torch

from jascl.networks.base import create_segmenter


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backbone", default="unet3d-authors")
    parser.add_argument("--sizes", default="96,128,160", help="cube edges, voxels")
    parser.add_argument("--classes", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = create_segmenter(args.backbone, 3, 1, args.classes).eval()
    start = peak_mib()
    print(f"{args.backbone}, float32, {args.threads} threads; peak RSS before the first forward {start:.0f} MiB")
    print("| volume | voxels (M) | peak RSS after (MiB) | seconds |")
    print("|---|---|---|---|")
    rows = []
    for edge in (int(v) for v in args.sizes.split(",")):
        x = torch.randn(1, 1, edge, edge, edge)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.forward_features(x)
        seconds = time.perf_counter() - t0
        rows.append((x.numel() / 1e6, peak_mib()))
        print(f"| {edge}^3 | {rows[-1][0]:.2f} | {rows[-1][1]:.0f} | {seconds:.1f} |")
        del out
    if len(rows) > 1:
        (v0, m0), (v1, m1) = rows[0], rows[-1]
        print(f"peak growth per million voxels, first to last size: {(m1 - m0) / (v1 - v0):.0f} MiB")


if __name__ == "__main__":
    main()
