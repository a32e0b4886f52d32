"""The run's device, precision, optimiser and learning-rate schedule (what ``RunConfig`` says about them)."""

from __future__ import annotations

import torch

from jascl.engine.config import RunConfig


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_precision(precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype of the run (None = fp32): "auto" is bf16 on a GPU that supports it."""
    if precision == "bf16":
        return torch.bfloat16
    if precision == "auto" and device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return None


def apply_cudnn_benchmark(enabled: bool, device: torch.device) -> None:
    """On a GPU, let cuDNN time its convolution algorithms for each new input shape and keep the fastest
    (``torch.backends.cudnn.benchmark``): worth it for fixed training patches, at the cost of run-to-run
    bit-exactness. On a CPU the process-wide flag is left as it is."""
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = bool(enabled)


def make_optimizer(cfg: RunConfig, params: list, lr: float) -> torch.optim.Optimizer:
    """The run configuration's optimiser (``optimizer``: sgd, adam or adamw) over ``params``."""
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=cfg.weight_decay)
    return torch.optim.SGD(
        params, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, nesterov=cfg.nesterov and cfg.momentum > 0
    )


def own_optimizer_note(optimizer: torch.optim.Optimizer, cfg: RunConfig) -> str | None:
    """What a method's own optimiser (:meth:`~jascl.engine.plugin.Plugin.make_optimizer`) changes against the
    configured ``optimizer``: e.g. "SGD, not the configured adam" for UCL, whose ρ group needs SGD; None where it
    is of the configured kind, or trains nothing (a training-free method's rate-0 SGD)."""
    kinds = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}
    if type(optimizer) is kinds[cfg.optimizer] or all(g["lr"] == 0 for g in optimizer.param_groups):
        return None
    return f"{type(optimizer).__name__}, not the configured {cfg.optimizer}"


def schedule_lr(optimizer: torch.optim.Optimizer, cfg: RunConfig, epoch: int, epochs: int) -> None:
    """Set every parameter group's rate for ``epoch`` of ``epochs`` (``lr_schedule``; constant: untouched).

    poly: ``initial_lr * (1 - epoch / epochs) ** lr_power``. A pure function of the epoch and of the
    rate each group had at creation (kept in the group, hence in the optimiser's checkpoint), so a
    resumed session continues the schedule exactly.
    """
    if cfg.lr_schedule != "poly":
        return
    factor = (1.0 - epoch / max(epochs, 1)) ** cfg.lr_power
    for group in optimizer.param_groups:
        group["lr"] = group["initial_lr"] * factor
