"""Size and write time of one in-session checkpoint (``progress.safetensors``) for paper-sized models.

Helps choose ``checkpoint_steps``: a checkpoint every N steps costs one such
write every N steps. For each backbone, builds the segmenter (20 classes, no
pretrained weights), gives the optimizer its per-parameter state (SGD momentum,
or Adam's two moments with ``--optimizer adam``), and writes the payload the
trainer writes inside an epoch with :func:`jascl.engine.checkpoint.save_progress`
(atomic: temporary file + rename), ``--repeats`` times; prints the best time.

Usage::

    python benchmarks/checkpoint_cost.py [--optimizer adam] [--dir /path/on/the/run/disk]

The write goes through the page cache (no fsync), as the trainer's does; on a
network file system the time is that of moving the bytes there.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch

from jascl.engine.checkpoint import save_progress
from jascl.engine.snapshot import module_state, rng_state
from jascl.networks.base import create_segmenter

#: (backbone, spatial dims, input channels): the paper's natural and medical backbones
MODELS = (("deeplabv3plus", 2, 3), ("unet3d-authors", 3, 1), ("medformer", 3, 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    args = parser.parse_args()
    folder = Path(args.dir or tempfile.mkdtemp())
    folder.mkdir(parents=True, exist_ok=True)
    print(f"| backbone | parameters | optimizer | file | write (best of {args.repeats}) |")
    print("|---|---|---|---|---|")
    for name, dims, channels in MODELS:
        model = create_segmenter(name, dims, channels, 20)
        params = list(model.parameters())
        opt = (torch.optim.Adam(params, lr=1e-3) if args.optimizer == "adam"
               else torch.optim.SGD(params, lr=0.01, momentum=0.9))
        for p in params:
            p.grad = torch.zeros_like(p)
        opt.step()  # the optimizer's per-parameter state exists, as in a session under way
        payload = {"epoch": 3, "iteration": 1000, "model": module_state(model), "optimizer": opt.state_dict(),
                   "plugins": {}, "loader": {"passes": 3}, "rng": rng_state(), "metrics": {},
                   "inside": {"step": 500, "running": torch.tensor(1.0),
                              "loader_start": {"passes": 3, "generator": None}}}
        path = folder / f"{name}-progress.safetensors"
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            save_progress(path, {"protocol": "benchmark", "backbone": name}, payload)
            times.append(time.perf_counter() - start)
        size = os.path.getsize(path) / 2 ** 20
        path.unlink()
        print(f"| {name} | {sum(p.numel() for p in params) / 1e6:.1f} M | {args.optimizer} | {size:.0f} MiB | "
              f"{min(times):.2f} s |")


if __name__ == "__main__":
    main()
