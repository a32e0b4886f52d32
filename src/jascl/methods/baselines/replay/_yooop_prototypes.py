"""YoooP's pure functions: attentional mean-shift, the prototype loss and its optimisation, the cosine
histogram and angular feature synthesis, feature distillation, and fitting class prototypes from pixel
features (:mod:`.yooop` holds the method and its docstring)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from jascl.engine.prototypes import align_labels
from jascl.methods.common import labelled_loader, whole_forward
from jascl.networks.base import eval_mode

if TYPE_CHECKING:
    from jascl.engine.state import LoopState
    from jascl.networks.base import Segmenter


def pixels(features: torch.Tensor) -> torch.Tensor:
    """(B, D, *spatial) -> (B * prod(spatial), D), one row per pixel (2D or 3D)."""
    return features.movedim(1, -1).reshape(-1, features.shape[1])


def attention_weights(unit_features: torch.Tensor, prototype: torch.Tensor, temperature: float) -> torch.Tensor:
    """YoooP's attention of a prototype over its class's embeddings: ``softmax_i(cos(z_i, p) / temperature)``.

    Args:
        unit_features: (N, D) L2-normalised features of one class.
        prototype: (D,) prototype (normalised here).
        temperature: softmax temperature (> 0).

    Returns:
        (N,) weights summing to 1.
    """
    return F.softmax(unit_features @ F.normalize(prototype, dim=0) / temperature, dim=0)


def attentional_mean_shift(
    unit_features: torch.Tensor, prototype: torch.Tensor | None, temperature: float, steps: int
) -> torch.Tensor:
    """YoooP's attentional mean-shift: ``p <- normalize(sum_i a_i z_i)`` with :func:`attention_weights`, ``steps`` times.

    Each step moves the prototype towards where the class's embeddings are dense (pixels close to it weigh
    more than outliers). Starts from ``prototype``, or from the normalised mean when None.

    Args:
        unit_features: (N, D) L2-normalised features of one class (N >= 1).
        prototype: (D,) starting point or None.
        temperature: attention temperature.
        steps: mean-shift iterations (0: the start itself, normalised).

    Returns:
        (D,) unit prototype.
    """
    p = F.normalize(unit_features.mean(0) if prototype is None else prototype, dim=0)
    for _ in range(steps):
        p = F.normalize(attention_weights(unit_features, p, temperature) @ unit_features, dim=0)
    return p


def prototype_loss(
    unit_features: torch.Tensor,
    labels: torch.Tensor,
    prototypes: torch.Tensor,
    classes: Sequence[int],
    temperature: float,
) -> torch.Tensor:
    """YoooP's prototype optimisation loss, prototype-anchored: similar to its class, dissimilar to the rest.

    For prototype k of class c_k, ``s_ik = cos(z_i, p_k) / temperature`` over all pixels i, and
    ``L_k = logsumexp_i s_ik - logsumexp_{i: y_i = c_k} s_ik`` = ``-log`` of the attention mass the
    prototype puts on its own class's pixels. The loss is the mean of ``L_k`` over the prototypes whose
    class has at least one pixel (0, with a graph, when none has).

    Args:
        unit_features: (N, D) L2-normalised pixel features.
        labels: (N,) class labels of the pixels (any id space shared with ``classes``; others = any other value).
        prototypes: (K, D) prototypes (normalised here).
        classes: (K,) the class of each prototype.
        temperature: similarity temperature.
    """
    sims = unit_features @ F.normalize(prototypes, dim=1).t() / temperature  # (N, K)
    own = labels.unsqueeze(1) == torch.as_tensor(list(classes), device=labels.device).unsqueeze(0)  # (N, K)
    present = own.any(dim=0)
    if not bool(present.any()):
        return sims.sum() * 0.0
    sims, own = sims[:, present], own[:, present]  # an absent class's all -inf column would give NaN gradients
    return (torch.logsumexp(sims, dim=0) - torch.logsumexp(sims.masked_fill(~own, float("-inf")), dim=0)).mean()


def optimize_prototypes(
    unit_features: torch.Tensor,
    labels: torch.Tensor,
    prototypes: torch.Tensor,
    classes: Sequence[int],
    temperature: float,
    steps: int,
    lr: float,
) -> torch.Tensor:
    """Projected gradient descent of :func:`prototype_loss` on the prototypes alone (features fixed).

    ``P <- normalize(P - lr * dL/dP)``, ``steps`` times (deterministic). Returns (K, D) unit prototypes.
    """
    p = F.normalize(prototypes.detach(), dim=1)
    z = unit_features.detach()
    for _ in range(steps):
        with torch.enable_grad():
            q = p.clone().requires_grad_(True)
            (grad,) = torch.autograd.grad(prototype_loss(z, labels, q, classes, temperature), q)
        p = F.normalize(p - lr * grad, dim=1)
    return p


def cosine_histogram(unit_features: torch.Tensor, prototype: torch.Tensor, bins: int) -> torch.Tensor:
    """YoooP+'s stored angular distribution: the histogram of ``cos(z_i, p)`` over ``bins`` equal bins of [-1, 1].

    Bin b covers ``[-1 + 2b/bins, -1 + 2(b+1)/bins)``; cosine 1 falls in the last bin.

    Args:
        unit_features: (N, D) L2-normalised features of the class (N >= 1).
        prototype: (D,) its prototype (normalised here).

    Returns:
        (bins,) probabilities (float64, summing to 1).
    """
    cos = (unit_features.double() @ F.normalize(prototype.double(), dim=0)).clamp(-1.0, 1.0)
    index = ((cos + 1.0) * bins / 2.0).floor().long().clamp(0, bins - 1)
    counts = torch.bincount(index, minlength=bins).double()
    return counts / counts.sum()


def sample_angular_features(
    prototype: torch.Tensor, histogram: torch.Tensor, n: int, generator: torch.Generator | None = None
) -> torch.Tensor:
    """YoooP+'s synthetic embeddings: unit vectors whose cosine to the prototype follows ``histogram``.

    A cosine ``s`` is drawn from the histogram (a bin by its probability, then uniformly inside it) and a
    direction ``u`` uniformly among the unit vectors orthogonal to the prototype; the sample is
    ``s p + sqrt(1 - s^2) u``, so ``cos(sample, p) = s`` exactly. (Isotropic Gaussian noise around ``p``
    would give almost the same angle to every sample in high dimension.)

    Args:
        prototype: (D,) prototype (normalised here), D >= 2.
        histogram: (bins,) probabilities over equal bins of [-1, 1] (:func:`cosine_histogram`).
        n: samples to draw.
        generator: the random stream (on the prototype's device).

    Returns:
        (n, D) unit vectors.
    """
    p = F.normalize(prototype, dim=0)
    bins = histogram.numel()
    probs = histogram.to(device=p.device, dtype=torch.float64)
    index = torch.multinomial(probs, n, replacement=True, generator=generator)
    offset = torch.rand(n, generator=generator, device=p.device, dtype=torch.float64)
    s = (-1.0 + (index.double() + offset) * 2.0 / bins).clamp(-1.0, 1.0).to(p.dtype)
    u = torch.randn(n, p.numel(), generator=generator, device=p.device, dtype=p.dtype)
    u = F.normalize(u - (u @ p).unsqueeze(1) * p, dim=1)
    return s.unsqueeze(1) * p + (1.0 - s**2).clamp_min(0.0).sqrt().unsqueeze(1) * u


def feature_distillation(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """Feature distillation: the mean over pixels of ``||f_student - f_teacher||_2`` (over channels).

    Args:
        student, teacher: (B, D, *spatial) pre-classifier features.
    """
    return (student - teacher).norm(dim=1).mean()


# ----------------------------------------------------------------------------------------------- store


@dataclass
class ClassPrototype:
    """What YoooP(+) keeps for one class.

    Attributes:
        prototype: (D,) the optimised unit prototype.
        norm: mean feature norm of the class's pixels (the scale of replayed features).
        histogram: (bins,) distribution of ``cos(pixel feature, prototype)`` (YoooP+).
    """

    prototype: torch.Tensor
    norm: float
    histogram: torch.Tensor


@torch.no_grad()
def gather_pixel_features(
    model: Segmenter, state: LoopState, classes: Sequence[int], max_pixels: int, generator: torch.Generator
) -> dict[int, torch.Tensor]:
    """A seeded subsample of the session's labelled pixel features per class (eval mode, at most ``max_pixels``).

    Each batch contributes at most ``ceil(max_pixels / batches)`` random pixels per class.

    Returns:
        global class id -> (n_c, D) raw features (classes without pixels are left out).
    """
    loader = labelled_loader(state)
    per_batch = max(math.ceil(max_pixels / max(len(loader), 1)), 1)
    out: dict[int, list[torch.Tensor]] = {c: [] for c in classes}
    with eval_mode(model):
        for batch in loader:
            features = whole_forward(state, model, batch["image"].to(state.device)).features.float()
            labels = align_labels(batch["label"].to(state.device), features.shape[2:]).reshape(-1)
            flat = pixels(features)
            for c in classes:
                where = (labels == c).nonzero()[:, 0]
                if where.numel() > per_batch:
                    pick = torch.randperm(where.numel(), generator=generator)[:per_batch]
                    where = where[pick.to(where.device)]
                if where.numel():
                    out[c].append(flat[where])
    return {c: torch.cat(v)[:max_pixels] for c, v in out.items() if v}


def fit_prototypes(
    gathered: dict[int, torch.Tensor],
    taught: Sequence[int],
    temperature: float,
    mean_shift_steps: int,
    optimize_steps: int,
    lr: float,
    bins: int,
) -> dict[int, ClassPrototype]:
    """Mean-shift, then jointly optimise, the prototypes of the ``taught`` classes on gathered pixels.

    Every gathered class (background included) supplies "other" pixels to the optimisation.
    """
    anchors = [c for c in taught if c in gathered]
    if not anchors:
        return {}
    unit = {c: F.normalize(f, dim=1) for c, f in gathered.items()}
    start = torch.stack([attentional_mean_shift(unit[c], None, temperature, mean_shift_steps) for c in anchors])
    everything = torch.cat([unit[c] for c in gathered])
    labels = torch.cat([torch.full((len(unit[c]),), c, dtype=torch.long, device=everything.device) for c in gathered])
    final = optimize_prototypes(everything, labels, start, anchors, temperature, optimize_steps, lr)
    return {
        c: ClassPrototype(
            final[k].cpu(), float(gathered[c].norm(dim=1).mean()), cosine_histogram(unit[c], final[k], bins).cpu()
        )
        for k, c in enumerate(anchors)
    }


# ----------------------------------------------------------------------------------------------- plugin
