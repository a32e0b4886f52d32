"""What the sharpness-aware baselines share: gradient norms, ascent steps, evaluating the loss at displaced
weights, and BatchNorm statistics frozen during the extra forwards."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

if TYPE_CHECKING:
    pass


def global_norm(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """||(t_1, ..., t_n)||_2 over all elements of all tensors."""
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t) for t in tensors]))


def ascent_step(grads: Sequence[torch.Tensor], rho: float, eps: float = 1e-12) -> list[torch.Tensor]:
    """SAM's first-order worst-case perturbation e = rho * g / ||g||_2 (Foret et al., ICLR 2021).

    The norm is taken over the whole parameter vector (all tensors together).
    """
    scale = rho / (global_norm(grads) + eps)
    return [g * scale for g in grads]


@contextlib.contextmanager
def frozen_bn_statistics(model: nn.Module) -> Iterator[None]:
    """BatchNorm running statistics left untouched by the extra forward passes (as SAM / C-Flat code does)."""
    saved = []
    for m in model.modules():
        if isinstance(m, _BatchNorm) and m.training and m.track_running_stats:
            saved.append((m, m.momentum, None if m.num_batches_tracked is None else m.num_batches_tracked.clone()))
            m.momentum = 0.0
    try:
        yield
    finally:
        for m, momentum, tracked in saved:
            m.momentum = momentum
            if tracked is not None:
                m.num_batches_tracked.copy_(tracked)


def _trainable_with_grad(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]


def gradient_at(params: Sequence[torch.Tensor], closure: Callable[[], torch.Tensor]) -> list[torch.Tensor]:
    """Gradient of ``closure()`` w.r.t. ``params`` at their current values (also left in ``p.grad``)."""
    for p in params:
        p.grad = None
    with torch.enable_grad():
        closure().backward()
    return [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in params]


@contextlib.contextmanager
def displaced(params: Sequence[torch.Tensor], deltas: Sequence[torch.Tensor]) -> Iterator[None]:
    """Parameters moved to theta + delta inside the block and restored bit-exactly afterwards.

    Restoring a saved copy (rather than subtracting delta) keeps rounding from
    drifting the weights over many steps.
    """
    saved = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p, d in zip(params, deltas):
            p.add_(d)
    try:
        yield
    finally:
        with torch.no_grad():
            for p, s in zip(params, saved):
                p.copy_(s)
