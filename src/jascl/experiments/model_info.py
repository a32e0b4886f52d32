"""Model size and cost: parameters, FLOPs per forward, memory of one training step, with and without JASCL.

This reproduces the paper's computational analysis (Table "Computational
analysis for Session 1": parameters, FLOPs and cost with and without JASCL)
for any registered backbone.

How each number is obtained:
    * Parameters: ``sum(p.numel())`` over the segmenter (backbone + classifier);
      "trainable" counts only ``requires_grad`` ones. Like the paper's table (Session 1), the
      model is set up as in an incremental session: what the backbone freezes from session 1 on
      (SAM's image encoder, which trains in the base session) is frozen.
      GAS adds a buffer, not parameters, so JASCL never changes this count.
    * FLOPs: :class:`torch.utils.flop_counter.FlopCounterMode` over one forward
      of one image (with JASCL plus the classifier applied to the replayed
      prototypes), counting matmuls/convolutions/attention as
      2 x multiply-accumulates; element-wise ops (norms, activations, the GAS
      noise) are not counted. Many papers (and thop/fvcore) report MACs, half of
      this number; both are returned.
    * Training-step memory, on CUDA: ``torch.cuda.max_memory_allocated`` over
      one forward + backward + SGD (momentum) step, measured.
      Elsewhere it is an *estimate*, computed on the meta device (no real
      computation, so paper-size inputs are instant): bytes of parameters +
      gradients of trainable parameters + SGD momentum buffers + buffers +
      every tensor autograd saves for backward during the forward (collected
      with :func:`torch.autograd.graph.saved_tensors_hooks`, each storage
      counted once, parameters excluded). Transient workspace of individual
      kernels and the backward pass's own temporaries are not included, so the
      estimate is a lower bound of a real peak.
    * "with JASCL": the same step with GAS attached to the classifier (noise in
      the training forward, squared gradient stored after backward) and the
      prototype replay loss on ``num_prototypes`` random prototypes, weight 0.1.
    * Time (``time_steps`` > 0, ``jascl model-info --time N``): the median wall time of N
      training steps (forward + backward + SGD step on random inputs, after 2 warm-up
      steps, ``torch.cuda.synchronize`` around each on a GPU), on a real device. The
      paper's compute table gives hours per session (4h 06m with JASCL vs 4h 05m without
      on Med JASCL-Disjoint); the per-step ratio is what its difference comes from. The
      PAS mean teacher's unlabelled phases are not in the step (they depend on the pool).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from jascl.errors import ConfigError

if TYPE_CHECKING:
    from jascl.networks.base import Segmenter


@dataclass(frozen=True)
class InfoDefaults:
    """Paper-like default input for a backbone's model-info."""

    spatial_dims: int
    in_channels: int
    spatial_size: tuple[int, ...]
    num_classes: int
    backbone_args: dict


#: paper-like sizes: the authors' medical patches, natural images at 512 / SAM's native 1024
DEFAULTS: dict[str, InfoDefaults] = {
    "unet": InfoDefaults(3, 1, (128, 128, 128), 21, {}),
    "unet3d-authors": InfoDefaults(3, 1, (128, 120, 120), 21, {}),
    "monai-unet": InfoDefaults(3, 1, (128, 128, 128), 21, {}),
    "swinunetr": InfoDefaults(3, 1, (96, 96, 96), 21, {}),
    "medformer": InfoDefaults(3, 1, (128, 160, 96), 21, {}),
    "deeplabv3plus": InfoDefaults(2, 3, (512, 512), 20, {}),
    "sam-vitb": InfoDefaults(2, 3, (1024, 1024), 20, {}),
    "clip-driven": InfoDefaults(
        3,
        1,
        (128, 128, 128),
        21,
        {"encoding": "onehot", "classes": ["background", *(f"class_{i}" for i in range(1, 21))]},
    ),
}
FALLBACK = InfoDefaults(2, 1, (256, 256), 21, {})


def _as_in_session_1(model: Segmenter) -> Segmenter:
    """``model`` with what its backbone freezes in incremental sessions frozen (SAM's encoder), in train mode."""
    for module in model.backbone.frozen_modules(1):
        module.requires_grad_(False)
    return model.train()


def defaults_for(name: str) -> InfoDefaults:
    return DEFAULTS.get(name, FALLBACK)


def count_flops(model: nn.Module, x: torch.Tensor) -> int:
    """FLOPs (2 x MACs of matmul/conv/attention) of ``model(x)`` as FlopCounterMode counts them."""
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(x)
    return int(counter.get_total_flops())


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        key = _storage_key(t)
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def _train_step(
    model: nn.Module,
    x: torch.Tensor,
    labels: torch.Tensor,
    with_jascl: bool,
    num_prototypes: int,
    saved: dict[int, int] | None,
) -> None:
    """Forward + backward + SGD step; records saved-tensor bytes into ``saved`` when given."""
    from jascl.methods.gas import record_sq_grad
    from jascl.methods.replay import prototype_replay_loss

    params = [p for p in model.parameters() if p.requires_grad]
    param_keys = {_storage_key(p) for p in model.parameters()}
    optimizer = torch.optim.SGD(params, lr=1e-3, momentum=0.9)

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if saved is not None and key not in param_keys:
            saved[key] = t.untyped_storage().nbytes()
        return t

    hooks = (
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if saved is not None else contextlib.nullcontext()
    )
    with hooks:
        out = model.forward_features(x)
        loss = F.cross_entropy(out.logits, labels)
        if with_jascl:
            channels = model.classifier.in_channels
            protos = F.normalize(torch.randn(num_prototypes, channels, device=x.device), dim=1)
            targets = torch.randint(0, model.num_classes, (num_prototypes,), device=x.device)
            loss = loss + 0.1 * prototype_replay_loss(model.classifier, protos, targets)
    optimizer.zero_grad()
    loss.backward()
    if with_jascl:
        record_sq_grad(model.classifier)
    optimizer.step()


def _estimate_memory(
    model: nn.Module, x: torch.Tensor, labels: torch.Tensor, with_jascl: bool, num_prototypes: int
) -> int:
    saved: dict[int, int] = {}
    _train_step(model, x, labels, with_jascl, num_prototypes, saved)
    trainable = [p for p in model.parameters() if p.requires_grad]
    params = _bytes(model.parameters())
    grads_and_momentum = 2 * _bytes(trainable)
    buffers = _bytes(model.buffers())
    return params + grads_and_momentum + buffers + sum(saved.values()) + x.nbytes + labels.nbytes


def _measure_cuda_memory(
    model: nn.Module, x: torch.Tensor, labels: torch.Tensor, with_jascl: bool, num_prototypes: int
) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    _train_step(model, x, labels, with_jascl, num_prototypes, None)
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated())


def _input_of(
    name: str,
    spatial_dims: int | None,
    in_channels: int | None,
    num_classes: int | None,
    spatial_size: tuple[int, ...] | None,
    backbone_args: dict | None,
) -> tuple[int, int, int, tuple[int, ...], dict]:
    """The model and input, each ``None`` replaced by the backbone's paper-like default (:data:`DEFAULTS`)."""
    d = defaults_for(name)
    spatial_dims = d.spatial_dims if spatial_dims is None else spatial_dims
    in_channels = d.in_channels if in_channels is None else in_channels
    num_classes = d.num_classes if num_classes is None else num_classes
    backbone_args = dict(d.backbone_args if backbone_args is None else backbone_args)
    if spatial_size is None:
        spatial_size = d.spatial_size if len(d.spatial_size) == spatial_dims else (d.spatial_size[-1],) * spatial_dims
    return spatial_dims, in_channels, num_classes, tuple(spatial_size), backbone_args


def _timed_step(
    model: nn.Module, x: torch.Tensor, labels: torch.Tensor, with_jascl: bool, num_prototypes: int
) -> float:
    cuda = x.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(x.device)
    start = time.perf_counter()
    _train_step(model, x, labels, with_jascl, num_prototypes, None)
    if cuda:
        torch.cuda.synchronize(x.device)
    return time.perf_counter() - start


def step_times(
    name: str,
    steps: int,
    spatial_dims: int | None = None,
    in_channels: int | None = None,
    num_classes: int | None = None,
    spatial_size: tuple[int, ...] | None = None,
    backbone_args: dict | None = None,
    batch_size: int = 2,
    num_prototypes: int = 40,
    device: str | None = None,
    warmup: int = 2,
) -> tuple[float, float]:
    """Median seconds of one training step without and with JASCL (GAS + prototype replay), interleaved.

    Two identical models (same seed), one with GAS on the classifier, take turns step by step on the same
    random batch (``warmup`` untimed steps each first), so a busy machine slows both alike. ``device``:
    "cuda" or "cpu" (default: cuda if available).
    """
    from jascl.methods.gas import attach_gas
    from jascl.networks import create_segmenter

    if steps < 1:
        raise ConfigError(f"--time {steps}: give the number of steps to time (>= 1)")
    spatial_dims, in_channels, num_classes, spatial_size, backbone_args = _input_of(
        name, spatial_dims, in_channels, num_classes, spatial_size, backbone_args
    )
    where = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if where.type not in ("cuda", "cpu"):
        raise ConfigError(f"--time-device {device}: timing needs a real device, cuda or cpu")
    models = []
    for jascl in (False, True):
        torch.manual_seed(0)
        m = _as_in_session_1(
            create_segmenter(
                name, spatial_dims=spatial_dims, in_channels=in_channels, num_classes=num_classes, **backbone_args
            )
        ).to(where)
        if jascl:
            attach_gas(m.classifier)
        m.train()
        models.append(m)
    x = torch.randn(batch_size, in_channels, *spatial_size, device=where)
    y = torch.randint(0, num_classes, (batch_size, *spatial_size), device=where)
    times: tuple[list[float], list[float]] = ([], [])
    for i in range(warmup + steps):
        for k, jascl in enumerate((False, True)):
            t = _timed_step(models[k], x, y, jascl, num_prototypes)
            if i >= warmup:
                times[k].append(t)
    return statistics.median(times[0]), statistics.median(times[1])


def model_info(
    name: str,
    spatial_dims: int | None = None,
    in_channels: int | None = None,
    num_classes: int | None = None,
    spatial_size: tuple[int, ...] | None = None,
    backbone_args: dict | None = None,
    with_jascl: bool = False,
    batch_size: int = 2,
    num_prototypes: int = 40,
    device: str | None = None,
) -> dict:
    """Parameters, FLOPs per forward and training-step memory of a registered backbone + classifier.

    Args:
        name: registered backbone name.
        spatial_dims, in_channels, num_classes, spatial_size, backbone_args: the
            model and input; ``None`` takes the backbone's paper-like default
            (:data:`DEFAULTS`).
        with_jascl: measure the training step with GAS on the classifier and
            prototype replay (``num_prototypes`` random prototypes).
        batch_size: images per training step (FLOPs are always per image).
        num_prototypes: stored prototypes replayed per step with JASCL.
        device: "cuda" (measured memory), "meta" (estimated memory) or None
            (cuda if available, else meta).

    Returns:
        dict with name, spatial_dims, in_channels, num_classes, spatial_size,
        batch_size, with_jascl, params_m, trainable_params_m, gflops, gmacs,
        train_memory_mib, memory_method ("measured (cuda max_memory_allocated)"
        or "estimated (params+grads+momentum+buffers+saved activations)"), device.
    """
    from jascl.methods.gas import attach_gas
    from jascl.networks import BACKBONES, create_segmenter

    if name not in BACKBONES:
        BACKBONES.get(name)  # raises the ConfigError listing the known names
    spatial_dims, in_channels, num_classes, spatial_size, backbone_args = _input_of(
        name, spatial_dims, in_channels, num_classes, spatial_size, backbone_args
    )
    spatial_size = tuple(int(s) for s in spatial_size)
    if len(spatial_size) != spatial_dims:
        raise ConfigError(
            f"spatial_size={list(spatial_size)} has {len(spatial_size)} entries, spatial_dims={spatial_dims}"
        )
    device = device or ("cuda" if torch.cuda.is_available() else "meta")

    model = _as_in_session_1(
        create_segmenter(
            name, spatial_dims=spatial_dims, in_channels=in_channels, num_classes=num_classes, **backbone_args
        )
    )
    model.backbone.check_input_size(spatial_size, "spatial_size")
    params = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    model = model.to(device)
    if with_jascl:
        attach_gas(model.classifier)

    model.eval()
    flops = count_flops(model, torch.zeros(1, in_channels, *spatial_size, device=device))
    if with_jascl:  # the replay loss runs the classifier on the stored prototypes once per step
        flops += count_flops(model.classifier, torch.zeros(num_prototypes, model.classifier.in_channels, device=device))
    model.train()
    x = torch.zeros(batch_size, in_channels, *spatial_size, device=device)
    labels = torch.zeros(batch_size, *spatial_size, dtype=torch.long, device=device)
    if device == "meta":
        memory = _estimate_memory(model, x, labels, with_jascl, num_prototypes)
        method = "estimated (params+grads+momentum+buffers+saved activations)"
    elif device.startswith("cuda"):
        memory = _measure_cuda_memory(model, x, labels, with_jascl, num_prototypes)
        method = "measured (cuda max_memory_allocated)"
    else:
        raise ConfigError(f"device={device!r}: model-info runs on 'cuda' (measured) or 'meta' (estimated)")
    return {
        "name": name,
        "spatial_dims": spatial_dims,
        "in_channels": in_channels,
        "num_classes": num_classes,
        "spatial_size": list(spatial_size),
        "batch_size": batch_size,
        "with_jascl": with_jascl,
        "params_m": params / 1e6,
        "trainable_params_m": trainable / 1e6,
        "gflops": flops / 1e9,
        "gmacs": flops / 2e9,
        "train_memory_mib": memory / 2**20,
        "memory_method": method,
        "device": device,
    }


def _parse_size(text: str | None, spatial_dims: int | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        parts = [int(v) for v in text.lower().replace(",", "x").split("x") if v.strip()]
    except ValueError:
        raise ConfigError(f"--spatial-size {text!r}: write sizes like 128x120x120 or 512") from None
    if len(parts) == 1 and spatial_dims:
        parts = parts * spatial_dims
    return tuple(parts)


def _parse_backbone_args(text: str | None) -> dict | None:
    if text is None:
        return None
    import yaml

    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"--backbone-args: not valid YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(value, dict):
        raise ConfigError(f'--backbone-args {text!r}: expected a mapping such as "{{feature_size: 24}}"')
    return value


def cmd_model_info(args: argparse.Namespace) -> int:
    """Print parameters, GFLOPs and training-step memory without/with JASCL for one or all backbones."""
    from rich.console import Console
    from rich.table import Table

    from jascl.networks import BACKBONES

    names = BACKBONES.list() if args.backbone == "all" else [args.backbone]
    backbone_args = _parse_backbone_args(args.backbone_args)
    rows = []
    for name in names:
        dims = args.spatial_dims or defaults_for(name).spatial_dims
        common = dict(
            spatial_dims=args.spatial_dims,
            in_channels=args.in_channels,
            num_classes=args.num_classes,
            spatial_size=_parse_size(args.spatial_size, dims),
            backbone_args=backbone_args,
            batch_size=args.batch_size,
        )
        a, b = (
            model_info(name, with_jascl=False, device=args.device, **common),
            model_info(name, with_jascl=True, device=args.device, **common),
        )
        if args.time:
            a["step_seconds"], b["step_seconds"] = step_times(name, args.time, device=args.time_device, **common)
            a["time_device"] = b["time_device"] = args.time_device or ("cuda" if torch.cuda.is_available() else "cpu")
        rows.append((a, b))
    console = Console(width=None if sys.stdout.isatty() else 170)  # keep the table readable in logs
    if args.json:
        console.print_json(json.dumps([{"without_jascl": a, "with_jascl": b} for a, b in rows]))
        return 0
    table = Table(
        title=f"model-info (batch {args.batch_size} for memory; per image: GMACs = multiply-accumulates, as the "
        "paper and thop/fvcore count; GFLOPs = 2 x GMACs)"
    )
    for col in (
        "backbone",
        "input",
        "params (M)",
        "trainable (M)",
        "GMACs",
        "GMACs +JASCL",
        "GFLOPs",
        "GFLOPs +JASCL",
        "train mem (MiB)",
        "mem +JASCL (MiB)",
        "mem overhead",
        *(("s/step", "s/step +JASCL", "time ratio") if args.time else ()),
    ):
        table.add_column(col, justify="left" if col in ("backbone", "input") else "right")
    for a, b in rows:
        size = "x".join(map(str, a["spatial_size"]))
        overhead = b["train_memory_mib"] - a["train_memory_mib"]
        table.add_row(
            a["name"],
            f"{a['in_channels']}x{size} ({a['spatial_dims']}D, K={a['num_classes']})",
            f"{a['params_m']:.2f}",
            f"{a['trainable_params_m']:.2f}",
            f"{a['gmacs']:.1f}",
            f"{b['gmacs']:.1f}",
            f"{a['gflops']:.1f}",
            f"{b['gflops']:.1f}",
            f"{a['train_memory_mib']:.0f}",
            f"{b['train_memory_mib']:.0f}",
            f"+{overhead:.2f} MiB ({100 * overhead / a['train_memory_mib']:.3f}%)",
            *(
                (f"{a['step_seconds']:.4f}", f"{b['step_seconds']:.4f}", f"{b['step_seconds'] / a['step_seconds']:.3f}")
                if args.time
                else ()
            ),
        )
    console.print(table)
    console.print(f"memory: {rows[0][0]['memory_method']} on {rows[0][0]['device']}")
    if args.time:
        console.print(
            f"time: median of {args.time} training steps each, without and with JASCL taking turns (after 2 warm-up "
            f"steps), on {rows[0][0]['time_device']}, batch {args.batch_size}"
        )
    return 0
