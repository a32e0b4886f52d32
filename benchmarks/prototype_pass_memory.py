"""Peak memory of a prototype pass over one large volume: stitched whole, or taken in blocks.

Runs :func:`jascl.engine.tasks.segmentation.accumulate_prototypes` (the pass every prototype request of a session
goes through) on one random volume with random labels, once with no bound on the stitched features (the pass
before blocks) and once with ``--max-elements``, each in a process of its own so that each peak RSS is its own
pass's; prints both peaks, the seconds, the number of blocks, and the largest difference between the two passes'
prototypes (per-sample prototypes of 8 classes and their complements, and the class means).

``--statistics fecam``: FeCAM's class-statistics pass instead (``eval_features`` into its Gaussian accumulator,
as C-FSCIL's and NC-FSCIL's class means also go): whole is ``pieces=False`` (every batch whole, logits and
features stitched), blocked ``pieces=True``; the difference is over the class means and covariances.
``--statistics per-sample``: PIFS's prototype initialisation, then GAPS's scene embedding, through
``sample_pieces`` (whole: the pass's bound lifted, as both took every volume before; blocked: the bound).

Usage::

    python benchmarks/prototype_pass_memory.py
    python benchmarks/prototype_pass_memory.py --size 192 192 160 --max-elements 67108864
    python benchmarks/prototype_pass_memory.py --statistics fecam
    python benchmarks/prototype_pass_memory.py --statistics per-sample
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def one_pass(args: argparse.Namespace) -> None:
    from jascl.engine.prototypes import PrototypeRequest
    from jascl.engine.tasks import segmentation
    from jascl.networks.base import create_segmenter

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = create_segmenter("unet", 3, 1, args.classes, features=[8, 8, 16, 32, 64, args.channels]).eval()
    image = torch.randn(1, 1, *args.size)
    labels = torch.randint(0, args.classes, (1, *args.size))
    requests = [PrototypeRequest(tuple(range(args.classes))), PrototypeRequest((1, 2, 3), True, True, True)]
    accs = [r.accumulator() for r in requests]
    bound = args.max_elements if args.mode == "blocked" else 2**62
    segmentation.PROTOTYPE_BLOCK_ELEMENTS = bound
    blocks = segmentation.prototype_blocks(image, args.roi, args.overlap, args.channels)
    start = time.perf_counter()
    if args.statistics == "fecam":
        results = [fecam_statistics(args, model, image, labels)]
    elif args.statistics == "per-sample":
        results = [per_sample_statistics(args, model, image, labels)]
    else:
        with torch.no_grad():
            segmentation.accumulate_prototypes(model, image, labels, accs, args.roi, args.sw_batch_size, args.overlap)
        results = [r.result(a) for r, a in zip(requests, accs)]
    seconds = time.perf_counter() - start
    torch.save(results, args.out)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"peak_mib": peak, "seconds": seconds, "blocks": len(blocks) if blocks else 1}))


def fecam_statistics(args: argparse.Namespace, model, image: torch.Tensor, labels: torch.Tensor) -> dict:
    """FeCAM's pass over the volume: class -> mean, covariance (as tensors, for the comparison)."""
    from types import SimpleNamespace

    from jascl.methods.baselines.fewshot._shared import eval_features
    from jascl.methods.baselines.fewshot.fecam import GaussianAccumulator

    config = SimpleNamespace(patch_size=args.roi, sw_batch_size=args.sw_batch_size, sw_overlap=args.overlap)
    state = SimpleNamespace(config=config, device=torch.device("cpu"))
    acc = GaussianAccumulator(list(range(args.classes)), beta=0.5)
    for features, lab in eval_features(state, model, [{"image": image, "label": labels}], args.mode == "blocked"):
        acc.update(features, lab)
    stats = acc.compute()
    return {f"{c}.{k}": torch.as_tensor(v[k]) for c, v in stats.items() for k in (0, 1)}


def per_sample_statistics(args: argparse.Namespace, model, image: torch.Tensor, labels: torch.Tensor) -> dict:
    """PIFS's prototypes and GAPS's scene embedding of the volume (``sample_pieces``: whole below the bound that
    ``one_pass`` sets, in blocks above it)."""
    from types import SimpleNamespace

    from jascl.methods.baselines.fewshot._gaps_features import scene_embeddings
    from jascl.methods.baselines.fewshot._shared import sample_pieces
    from jascl.methods.baselines.fewshot.pifs import pifs_prototypes

    config = SimpleNamespace(
        patch_size=args.roi, sw_batch_size=args.sw_batch_size, sw_overlap=args.overlap, batch_size=1
    )
    state = SimpleNamespace(config=config, device=torch.device("cpu"))
    pieces = sample_pieces(state, model, [{"image": image, "label": labels}])
    out = {f"pifs.{c}": v for c, v in pifs_prototypes(pieces, list(range(1, args.classes))).items()}
    out["gaps.scene"] = scene_embeddings(state, model, [image[0]])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, nargs=3, default=[288, 288, 224])
    parser.add_argument("--roi", type=int, nargs=3, default=[96, 96, 96])
    parser.add_argument("--overlap", type=float, default=0.25)
    parser.add_argument("--sw-batch-size", type=int, default=2)
    parser.add_argument("--channels", type=int, default=32, help="feature channels (the authors' U-Net: 32)")
    parser.add_argument("--classes", type=int, default=8)
    parser.add_argument(
        "--max-elements", type=int, default=2**29, help="the blocked pass's bound (default: the pass's, 2^29)"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--statistics", choices=("prototypes", "fecam", "per-sample"), default="prototypes")
    parser.add_argument("--mode", choices=("whole", "blocked"), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode:
        one_pass(args)
        return
    voxels = args.size[0] * args.size[1] * args.size[2]
    print(
        f"volume {args.size} ({voxels / 1e6:.1f} M voxels), roi {args.roi}, overlap {args.overlap}, "
        f"{args.channels} feature channels, {args.threads} threads; stitched features whole: "
        f"{voxels * args.channels * 4 / 2**20:.0f} MiB in float32, bound {args.max_elements * 4 / 2**20:.0f} MiB"
    )
    print("| pass | blocks | peak RSS (MiB) | seconds |")
    print("|---|---|---|---|")
    outputs = {}
    with tempfile.TemporaryDirectory() as folder:
        for mode in ("whole", "blocked"):
            out = Path(folder) / f"{mode}.pt"
            argv = [a for a in sys.argv[1:]] + ["--mode", mode, "--out", str(out)]
            done = subprocess.run([sys.executable, __file__, *argv], capture_output=True, text=True, check=True)
            row = json.loads(done.stdout.strip().splitlines()[-1])
            print(f"| {mode} | {row['blocks']} | {row['peak_mib']:.0f} | {row['seconds']:.1f} |")
            outputs[mode] = torch.load(out, weights_only=True)
    difference = max(float((a[c] - b[c]).abs().max()) for a, b in zip(outputs["whole"], outputs["blocked"]) for c in a)
    print(f"largest difference between the two passes' prototypes: {difference:.2e}")


if __name__ == "__main__":
    main()
