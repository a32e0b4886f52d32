"""What restoring a shared session-0 base costs each method of an ablation, with and without the prototype cache.

Runs the JASCL variants of the paper's ablation (they share one keyed base) on a built-in protocol and reports the
passes over session 0's whole labelled samples, each restore's seconds and passes, the wall time, and every
method's all-class score per session. ``--cache on``: the base's own pass answers the restores' calls ahead
(``Plugin.restore_requests``) and every restore reads them; ``late``: nothing is answered ahead, the first restore
makes the pass and the others read it (the cache as it was on 2026-11-29); ``off`` bypasses
:mod:`jascl.engine.prototype_cache` (every restore makes its pass, as before the cache). The results must be the same
in all three.

Usage::

    python benchmarks/restored_prototypes.py --cache off
    python benchmarks/restored_prototypes.py --cache late
    python benchmarks/restored_prototypes.py --cache on
    python benchmarks/restored_prototypes.py --protocol synthetic-2d --methods jascl,jascl-no-gas --epochs 2 2
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from jascl.engine import prototype_cache
from jascl.engine.config import resolve_config
from jascl.engine.loop import ContinualTrainer
from jascl.engine.tasks.segmentation import SegmentationTask
from jascl.experiments.runner import run_benchmark
from jascl.methods.replay import PrototypeReplayPlugin
from jascl.protocols import get_protocol


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", choices=("on", "late", "off"), default="on")
    parser.add_argument("--protocol", default="synthetic-3d")
    parser.add_argument("--methods", default="jascl,jascl-no-gas,jascl-no-pas,jascl-no-replay")
    parser.add_argument("--epochs", type=int, nargs=2, default=(1, 1), metavar=("BASE", "INCREMENTAL"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--data-cache", default=None, help="the synthetic data's cache folder (default: temporary)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.cache == "off":
        prototype_cache.serve = lambda folder, requests, setting, model, compute: compute(list(requests))
    if args.cache in ("off", "late"):
        PrototypeReplayPlugin.restore_requests = lambda self, state: []  # type: ignore[method-assign]

    passes = [0]
    labelled = SegmentationTask.labelled_dataset

    def counted(self, t, augment, crop):  # a prototype pass reads whole samples (training reads crops)
        passes[0] += not crop and t == 0
        return labelled(self, t, augment, crop)

    restore = ContinualTrainer.restore_session
    restores: list[dict] = []

    def timed(self, t, folder, model, store):
        start, before = time.perf_counter(), passes[0]
        restore(self, t, folder, model, store)
        restores.append(
            {"method": self.method.name, "session": t, "s": round(time.perf_counter() - start, 3),
             "passes": passes[0] - before}
        )  # fmt: skip

    SegmentationTask.labelled_dataset = counted  # type: ignore[method-assign]
    ContinualTrainer.restore_session = timed  # type: ignore[method-assign]
    protocol = get_protocol(args.protocol)
    config = resolve_config(
        protocol.training,
        protocol.path,
        overrides=[f"epochs_base={args.epochs[0]}", f"epochs_incremental={args.epochs[1]}"],
    )
    methods = args.methods.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        results = run_benchmark(
            protocol, config, methods, Path(tmp) / "run", cache_dir=args.data_cache or Path(tmp) / "data",
            progress=False, echo=lambda *a: None,
        )  # fmt: skip
        wall = time.perf_counter() - start
    print(
        json.dumps(
            {
                "cache": args.cache,
                "wall_s": round(wall, 1),
                "session0_passes": passes[0],
                "restores": restores,
                "all": {m: [s["all"] for s in r["sessions"]] for m, r in results["methods"].items()},
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
