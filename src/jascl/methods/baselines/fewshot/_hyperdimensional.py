"""C-FSCIL's pure functions: hyperdimensional similarity and sharpening, bundling into prototypes, and the
meta-learning, nudging and retraining losses (:mod:`.cfscil` holds the method and its docstring)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from jascl.protocols.schema import IGNORE_INDEX

if TYPE_CHECKING:
    pass


def softabs(x: torch.Tensor, steepness: float = 10.0) -> torch.Tensor:
    """Soft absolute value sigmoid(s (x - 1/2)) + sigmoid(s (-x - 1/2)) (official ``softabs``). Any shape."""
    return torch.sigmoid(steepness * (x - 0.5)) + torch.sigmoid(steepness * (-x - 0.5))


def sharpen(similarity: torch.Tensor, kind: str = "softabs", steepness: float = 10.0) -> torch.Tensor:
    """The sharpening activation: "softabs" (:func:`softabs`) or "abs" (|x|). Any shape."""
    if kind == "softabs":
        return softabs(similarity, steepness)
    if kind == "abs":
        return similarity.abs()
    raise ValueError(f"unknown sharpening {kind!r} (softabs or abs)")


def represent(x: torch.Tensor, kind: str = "tanh") -> torch.Tensor:
    """The representation similarities are computed in: "tanh" or "real" (identity). Any shape."""
    if kind == "tanh":
        return torch.tanh(x)
    if kind == "real":
        return x
    raise ValueError(f"unknown representation {kind!r} (tanh or real)")


def cosine_similarity(queries: torch.Tensor, prototypes: torch.Tensor, representation: str = "tanh") -> torch.Tensor:
    """cos(rho(q_n), rho(p_k)) for every pair (official ``cosine_similarity_multi``).

    Args:
        queries: (N, d) projected activations.
        prototypes: (K, d) memory entries.
        representation: rho, "tanh" or "real".

    Returns:
        (N, K) cosine similarities.
    """
    q = F.normalize(represent(queries, representation), dim=1)
    p = F.normalize(represent(prototypes, representation), dim=1)
    return q @ p.t()


def bundle(activations: torch.Tensor, labels: torch.Tensor, classes: torch.Tensor) -> torch.Tensor:
    """Class prototypes: the mean of each class's activations (bundling).

    Args:
        activations: (N, d) projected activations of the support pixels.
        labels: (N,) class of each pixel.
        classes: (P,) classes to bundle, in output order.

    Returns:
        (P, d) means; a class without any pixel gets a zero vector.
    """
    match = (labels[:, None] == classes[None, :]).to(activations.dtype)  # (N, P)
    sums = match.t() @ activations
    counts = match.sum(0)
    return sums / counts.clamp_min(1.0)[:, None]


def attention_loss(
    similarity: torch.Tensor,
    target: torch.Tensor,
    sharpening: str = "softabs",
    steepness: float = 10.0,
    balanced: bool = False,
) -> torch.Tensor:
    """Meta-learning loss: BCE between the sharpened, sum-normalised similarities and the one-hot label.

    ``w = sharpen(s) / sum_k sharpen(s)_k``; a query's loss is the mean over its K entries of
    ``-(y log w + (1 - y) log(1 - w))``, the logarithms clamped at -100 as ``torch.nn.BCELoss``
    does (official ``metatrain_baseFSCIL`` criterion). Unbalanced, the loss is the mean over the N
    queries (the official mean over N x K entries); balanced, every target class present weighs the
    same: the mean over classes of the mean over that class's queries.

    Args:
        similarity: (N, K) cosine similarities of N queries to K prototypes.
        target: (N,) index of each query's prototype.
        balanced: weigh classes, not queries, equally.

    Returns:
        Scalar loss (0 for N = 0).
    """
    if similarity.shape[0] == 0:
        return similarity.sum() * 0.0
    weights = sharpen(similarity.float(), sharpening, steepness)
    weights = (weights / weights.sum(dim=1, keepdim=True).clamp_min(1e-12)).clamp(0.0, 1.0)
    onehot = F.one_hot(target, similarity.shape[1]).to(weights.dtype)
    log_w = torch.log(weights).clamp_min(-100.0)
    log_1mw = torch.log(1.0 - weights).clamp_min(-100.0)
    per_query = -(onehot * log_w + (1.0 - onehot) * log_1mw).mean(dim=1)
    if not balanced:
        return per_query.mean()
    counts = torch.bincount(target, minlength=similarity.shape[1]).to(per_query.dtype)
    present = int((counts > 0).sum())
    return (per_query / (counts[target] * present)).sum()


def episode_loss(
    activations: torch.Tensor,
    rows: torch.Tensor,
    representation: str = "tanh",
    sharpening: str = "softabs",
    steepness: float = 10.0,
    balanced: bool = True,
) -> torch.Tensor:
    """The episodic meta-learning loss on one batch of projected activations.

    The first half of the samples (``max(1, B // 2)``) is the support set: its
    activations, detached, are bundled per class; the rest is the query set (a
    batch of one sample is its own query set). Every query pixel of a class
    present in the support is scored by :func:`cosine_similarity` to the support
    prototypes and trained with :func:`attention_loss`, by default with every
    class weighing the same (``balanced``; the official episodes hold the same
    number of queries per class, while pixels of the background outnumber a
    small organ's by orders of magnitude).

    Args:
        activations: (B, d, *spatial) projected activations (2 or 3 spatial dims).
        rows: (B, *spatial) class index of every pixel at the activations' size (255 = ignore).

    Returns:
        Scalar loss; 0 (with the graph kept) when the support shows fewer than two classes or no query pixel is usable.
    """
    b, d = activations.shape[:2]
    n_support = max(1, b // 2)
    support = activations[:n_support].detach().movedim(1, -1).reshape(-1, d)
    support_rows = rows[:n_support].reshape(-1)
    query_part = activations[n_support:] if b > 1 else activations
    query_rows = (rows[n_support:] if b > 1 else rows).reshape(-1)
    query = query_part.movedim(1, -1).reshape(-1, d)
    keep = support_rows != IGNORE_INDEX
    classes = torch.unique(support_rows[keep])
    zero = activations.sum() * 0.0
    if classes.numel() < 2:
        return zero
    prototypes = bundle(support[keep], support_rows[keep], classes)
    lut = torch.full((256,), -1, dtype=torch.long, device=rows.device)
    lut[classes] = torch.arange(classes.numel(), device=rows.device)
    index = lut[query_rows.long().clamp(0, 255)]
    usable = index >= 0
    if not bool(usable.any()):
        return zero
    similarity = cosine_similarity(query[usable].float(), prototypes.float(), representation)
    return attention_loss(similarity, index[usable], sharpening, steepness, balanced)


def nudging_loss(
    candidates: torch.Tensor,
    initial: torch.Tensor,
    pair_mask: torch.Tensor | None = None,
    activation: str = "doubleexp",
    exponent: float = 4.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The prototype-nudging objective: quasi-orthogonality + deviation (official ``nudging_model``).

    With ``u_i = tanh(candidates_i)`` and ``c_ij = cos(u_i, u_j)``::

        orthogonality = mean over the masked pairs of  e^{a c} + e^{-a c} - 2   ("doubleexp")
                                                    or e^{a c} - 1             ("exp")
        deviation     = mean_i (1 - cos(u_i, tanh(initial_i)))

    Args:
        candidates: (G, d) nudged prototypes being optimised.
        initial: (G, d) prototypes before nudging.
        pair_mask: (G, G) bool, the pairs to push apart (only i < j entries are read); None = every pair i < j.
        activation: "doubleexp" (official default) or "exp".
        exponent: a (official ``nudging_act_exp`` 4).

    Returns:
        (total, orthogonality, deviation) scalars; orthogonality is 0 without pairs.
    """
    g = candidates.shape[0]
    u = torch.tanh(candidates)
    unit = F.normalize(u, dim=1)
    upper = torch.ones(g, g, dtype=torch.bool, device=candidates.device).triu(1)
    mask = upper if pair_mask is None else upper & pair_mask.to(candidates.device)
    sims = (unit @ unit.t())[mask]
    if activation == "doubleexp":
        penalty = torch.exp(exponent * sims) + torch.exp(-exponent * sims) - 2.0
    elif activation == "exp":
        penalty = torch.exp(exponent * sims) - 1.0
    else:
        raise ValueError(f"unknown nudging activation {activation!r} (doubleexp or exp)")
    orthogonality = penalty.mean() if sims.numel() else candidates.sum() * 0.0
    deviation = (1.0 - F.cosine_similarity(u, torch.tanh(initial), dim=1)).mean()
    return orthogonality + deviation, orthogonality, deviation


def nudge_prototypes(
    prototypes: torch.Tensor,
    classes: torch.Tensor | None = None,
    iterations: int = 100,
    lr: float = 0.1,
    activation: str = "doubleexp",
    exponent: float = 4.0,
) -> torch.Tensor:
    """Nudge prototypes towards quasi-orthogonality: ``iterations`` SGD steps (Nesterov momentum 0.9) on
    :func:`nudging_loss`, starting from the prototypes (official ``nudge_prototypes``).

    Args:
        prototypes: (G, d) memory entries.
        classes: (G,) class of each entry; entries of the same class are not pushed apart. None = all distinct.

    Returns:
        (G, d) nudged prototypes (detached).
    """
    initial = prototypes.detach().float()
    mask = None if classes is None else classes[:, None] != classes[None, :]
    candidates = nn.Parameter(initial.clone())
    optimizer = torch.optim.SGD([candidates], lr=lr, momentum=0.9, nesterov=True)
    with torch.enable_grad():
        for _ in range(iterations):
            optimizer.zero_grad()
            total, _, _ = nudging_loss(candidates, initial, mask, activation, exponent)
            total.backward()
            optimizer.step()
    return candidates.detach()


def retrain_loss(projected: torch.Tensor, targets: torch.Tensor, representation: str = "tanh") -> torch.Tensor:
    """FCL retraining loss ``-mean_i cos(rho(projected_i), rho(targets_i))`` (official ``myCosineLoss``).

    Args:
        projected: (G, d) FCL outputs of the memory's GAAM entries.
        targets: (G, d) their (nudged or bipolarised) prototypes.
    """
    return -F.cosine_similarity(represent(projected, representation), represent(targets, representation), dim=1).mean()


def project(projection: nn.Linear, features: torch.Tensor) -> torch.Tensor:
    """The FCL applied per pixel: (B, C, *spatial) -> (B, d, *spatial); (N, C) -> (N, d)."""
    if features.dim() == 2:
        return projection(features)
    return projection(features.movedim(1, -1)).movedim(-1, 1)
