"""What best-validation model selection costs a session of a paper protocol, against the session's training.

The paper's protocols keep each session's best-validation epoch (``model_selection: best_val_new``), scored every
``validate_every`` epochs (default 1, as the authors' code). jascl scores validation samples as it evaluates
(``eval_mode``, default ``sliding-window``: every whole volume through MONAI's sliding windows); the authors scored
one centred crop per volume (``eval_mode: authors``). This script times, on one device, with the protocol's
backbone, patch, batch and class count at session ``--session``:

* one training step of the session (random patches; the session's frozen part frozen, as the loop does);
* the validation of ``--val-volumes`` volumes of shape ``--volume`` (random intensities and labels over the seen
  classes; the cost does not depend on the values), in ``sliding-window`` and in ``authors`` mode, through
  :func:`jascl.evaluation.evaluator.evaluate`;

and prints the seconds of one epoch's training and of one validation, and what the session's epochs add up to.
The real volumes' shapes come from your store (``jascl data check``); the sizes below are examples.

Usage::

    python benchmarks/validation_cost.py --protocol med-disjoint --session 1 --volume 240,240,200
    python benchmarks/validation_cost.py --protocol med-disjoint --session 0 --volume 270,270,400 --device cuda
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np
import torch

from jascl.data.types import Split
from jascl.engine.config import resolve_config
from jascl.evaluation.evaluator import evaluate, window_starts
from jascl.networks.base import create_segmenter
from jascl.protocols import get_protocol


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--protocol", default="med-disjoint")
    parser.add_argument("--session", type=int, default=1)
    parser.add_argument("--volume", default="240,240,200", help="validation volume shape (voxels, after resampling)")
    parser.add_argument("--val-volumes", type=int, help="validation volumes (default: the session's `validation`)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=3, help="timed training steps (after one warm-up)")
    parser.add_argument("--timed-volumes", type=int, default=1, help="volumes actually validated per mode")
    args = parser.parse_args()

    device = torch.device(args.device)
    protocol = get_protocol(args.protocol)
    config = resolve_config(protocol.training, protocol.path)
    t = args.session
    session = protocol.sessions[t]
    seen = protocol.seen_classes(t)
    shape = tuple(int(v) for v in args.volume.split(","))
    patch = tuple(config.patch_size)
    batch = config.batch_size
    taught = len(session.new_classes) + len(session.recurring_classes)
    samples = session.train if session.shots is None else session.shots * taught
    steps_per_epoch = math.ceil(samples / batch) if samples else 0
    epochs = config.epochs_base if t == 0 else config.epochs_incremental
    val_volumes = args.val_volumes or session.validation or 0

    model = create_segmenter(
        config.backbone, protocol.spatial_dims, protocol.in_channels, len(seen), **config.backbone_args
    ).to(device)
    if t > 0 and config.freeze_incremental == "all_but_classifier":
        model.backbone.requires_grad_(False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(trainable, lr=1e-3, momentum=0.9)
    amp = dict(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    x = torch.randn(batch, protocol.in_channels, *patch, device=device)
    y = torch.randint(0, len(seen), (batch, *patch), device=device)
    step_seconds = []
    for i in range(args.steps + 1):
        _sync(device)
        start = time.perf_counter()
        model.train()
        with torch.autocast(**amp):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        _sync(device)
        if i:  # the first step warms up
            step_seconds.append(time.perf_counter() - start)
    step = float(np.median(step_seconds))

    rng = np.random.default_rng(0)
    images = rng.standard_normal((args.timed_volumes, protocol.in_channels, *shape), dtype=np.float32)
    labels = rng.choice(np.asarray(seen, dtype=np.uint8), size=(args.timed_volumes, *shape))
    split = Split(images, labels, [f"v{i}" for i in range(args.timed_volumes)])
    per_volume = {}
    for mode in ("sliding-window", "authors"):
        _sync(device)
        start = time.perf_counter()
        with torch.autocast(**amp):
            evaluate(model, [split], seen, device, mode=mode, roi=patch, batch_size=1,
                     sw_batch_size=config.sw_batch_size, overlap=config.sw_overlap)  # fmt: skip
        _sync(device)
        per_volume[mode] = (time.perf_counter() - start) / args.timed_volumes
    windows = math.prod(len(window_starts(s, r, config.sw_overlap)) for s, r in zip(shape, patch))

    train_epoch = step * steps_per_epoch
    print(
        f"{args.protocol} session {t} ({session.name}) on {device}: backbone {config.backbone}, patch "
        f"{'x'.join(map(str, patch))}, batch {batch}, {len(seen)} classes, frozen: "
        f"{config.freeze_incremental if t else 'nothing'}; {samples} training samples -> {steps_per_epoch} steps "
        f"per epoch; {val_volumes} validation volumes of {'x'.join(map(str, shape))} ({windows} windows each at "
        f"overlap {config.sw_overlap}); {epochs} epochs, validate_every {config.validate_every}"
    )
    print()
    print("| | seconds | per epoch (s) | session, validated every epoch (h) |")
    print("|---|---|---|---|")
    print(f"| training step | {step:.3f} | {train_epoch:.1f} | {train_epoch * epochs / 3600:.2f} |")
    for mode, seconds in per_volume.items():
        per_epoch = seconds * val_volumes
        print(
            f"| validation, {mode}, one volume | {seconds:.3f} | {per_epoch:.1f} "
            f"({per_epoch / max(train_epoch, 1e-9):.2f} x training) | {per_epoch * epochs / 3600:.2f} |"
        )


if __name__ == "__main__":
    main()
