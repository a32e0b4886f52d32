"""BCM's pieces as pure functions (Sakai et al., NeurIPS 2024; official ``IBM/BCM``, ``src/bcm.py``): the base-novel
mapping mined from the base model's predictions on novel pixels, and the per-base-class logistic-regression refiner
with its cross-validated regularisation and class balancing.

Conventions: pixel features ``(N, D)``; labels ``(N,)`` int64; classes of a refiner are ``0`` ("not one of its novel
classes": background and every other class) and ``1..n`` (its novel classes, in the order the mapping lists them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torchmetrics.functional.classification import binary_average_precision

#: the official grid of inverse regularisation strengths (``np.logspace(-5, 5, 10)``)
DEFAULT_CS = tuple(float(c) for c in torch.logspace(-5, 5, 10, dtype=torch.float64))


def mine_base_classes(
    base_pred: torch.Tensor, labels: torch.Tensor, novel: Sequence[int], top_k: int
) -> dict[int, list[int]]:
    """The base-novel mapping (official ``init_table``): for every novel class, the base rows the base model predicts
    most often on its pixels, ``top_k`` of them (ties: the smaller row first); returned inverted, as base row -> the
    novel classes mapped to it (in the order of ``novel``).

    Args:
        base_pred: (N,) the base model's argmax over its rows (background included) at every labelled pixel.
        labels: (N,) the pixels' labels (novel class ids where a novel class is labelled).
        novel: the novel class ids.
        top_k: base rows kept per novel class (official default 1).
    """
    table: dict[int, list[int]] = {}
    for c in novel:
        rows, counts = torch.unique(base_pred[labels == c], return_counts=True)
        order = sorted(range(len(rows)), key=lambda i: (-int(counts[i]), int(rows[i])))[:top_k]
        for i in order:
            table.setdefault(int(rows[i]), []).append(int(c))
    return {k: table[k] for k in sorted(table)}


def under_sample(y: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Indices keeping, for every class of ``y``, a random ``n_min`` of its samples, ``n_min`` the smallest count
    among the classes other than 0 (official ``under_sampling``); all of ``y`` when it has no class other than 0."""
    classes, counts = torch.unique(y, return_counts=True)
    nonzero = counts[classes != 0]
    if nonzero.numel() == 0:
        return torch.arange(len(y))
    n_min = int(nonzero.min())
    keep = []
    for c in classes.tolist():
        idx = (y == c).nonzero().squeeze(1)
        keep.append(idx[torch.randperm(len(idx), generator=generator)[:n_min]])
    return torch.cat(keep).sort().values


def fit_logistic(x: torch.Tensor, y: torch.Tensor, num_classes: int, c: float, iterations: int = 100) -> torch.Tensor:
    """Multinomial logistic regression, scikit-learn's objective ``0.5 ||W||^2 + C * sum_i CE(x_i W^T + b, y_i)``
    (intercept unpenalised), minimised with L-BFGS (strong Wolfe line search).

    Returns:
        (num_classes, D + 1) weights, the intercept in the last column.
    """
    x = x.double()
    w = torch.zeros(num_classes, x.shape[1] + 1, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w], max_iter=iterations, line_search_fn="strong_wolfe", tolerance_grad=1e-9)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        logits = x @ w[:, :-1].T + w[:, -1]
        loss = 0.5 * (w[:, :-1] ** 2).sum() + c * F.cross_entropy(logits, y, reduction="sum")
        loss.backward()
        return loss

    opt.step(closure)
    return w.detach()


def predict_proba(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """(N, num_classes) class probabilities of :func:`fit_logistic`'s weights."""
    return torch.softmax(x.double() @ w[:, :-1].T + w[:, -1], dim=1)


def stratified_folds(y: torch.Tensor, n_splits: int) -> list[torch.Tensor]:
    """Test indices of ``n_splits`` stratified folds without shuffling (scikit-learn's ``StratifiedKFold``
    default): each class's samples, in order, cut into ``n_splits`` consecutive chunks, fold i taking chunk i."""
    folds: list[list[torch.Tensor]] = [[] for _ in range(n_splits)]
    for c in torch.unique(y).tolist():
        idx = (y == c).nonzero().squeeze(1)
        for i, chunk in enumerate(torch.tensor_split(idx, n_splits)):
            folds[i].append(chunk)
    return [torch.cat(f).sort().values for f in folds]


def mean_average_precision(proba: torch.Tensor, y: torch.Tensor) -> float:
    """Mean over the classes present in ``y`` of the one-vs-rest average precision of ``proba[:, c]``."""
    scores = [float(binary_average_precision(proba[:, c].float(), (y == c).long())) for c in torch.unique(y).tolist()]
    return sum(scores) / len(scores)


@dataclass
class Refiner:
    """A base row's refiner: its novel classes and its logistic-regression weights ``(n + 1, D + 1)``."""

    base_row: int
    novel: list[int]
    weights: torch.Tensor

    def proba(self, x: torch.Tensor) -> torch.Tensor:
        """(N, n + 1) probabilities of "not novel" (column 0) and of each novel class."""
        return predict_proba(self.weights.to(x.device), x)


def fit_refiner(
    x: torch.Tensor,
    y: torch.Tensor,
    base_row: int,
    novel: list[int],
    generator: torch.Generator,
    cs: Sequence[float] = DEFAULT_CS,
    n_splits: int = 5,
) -> Refiner:
    """The official ``exLogisticRegressionCV``: C chosen by ``n_splits``-fold stratified cross-validation on the mean
    average precision (training folds under-sampled), then a final fit on all pixels, under-sampled.

    Args:
        x: (N, D) pixel features. y: (N,) global class ids (labels; ignored pixels already removed).
        base_row: the base row the refiner serves. novel: the novel class ids mapped to it.
    """
    target = torch.zeros_like(y)
    for j, c in enumerate(novel):
        target[y == c] = j + 1
    k = len(novel) + 1
    counts = torch.bincount(target, minlength=k)
    splits = min(n_splits, int(counts[counts > 0].min()))
    if splits >= 2 and len(cs) > 1:
        folds = stratified_folds(target, splits)
        score = torch.zeros(len(cs), dtype=torch.float64)
        for test in folds:
            train = torch.ones(len(target), dtype=torch.bool)
            train[test] = False
            xt, yt = x[train], target[train]
            keep = under_sample(yt, generator)
            for i, c in enumerate(cs):
                w = fit_logistic(xt[keep], yt[keep], k, c)
                score[i] += mean_average_precision(predict_proba(w, x[test]), target[test])
        c_best = cs[int(score.argmax())]
    else:
        c_best = cs[len(cs) // 2]
    keep = under_sample(target, generator)
    return Refiner(base_row, list(novel), fit_logistic(x[keep], target[keep], k, c_best))


def refine(base_pred: torch.Tensor, x: torch.Tensor, refiners: Sequence[Refiner]) -> torch.Tensor:
    """The official prediction rule: a pixel the base model assigns to base row k takes the novel class a refiner of k
    predicts, where it predicts one (not column 0). With several refiners of one row (several sessions), the
    most probable of their novel predictions wins.

    Args:
        base_pred: (N,) base rows. x: (N, D) features. refiners: with ``novel`` as classifier rows.

    Returns:
        (N,) rows: ``base_pred`` with the refined pixels overridden.
    """
    out = base_pred.clone()
    best = torch.zeros(len(out), dtype=torch.float64, device=x.device)
    for r in refiners:
        where = base_pred == r.base_row
        if not bool(where.any()):
            continue
        proba = r.proba(x[where])
        p, j = proba.max(dim=1)
        take = (j > 0) & (p > best[where])
        rows = torch.tensor(r.novel, device=x.device)[(j - 1).clamp(min=0)]
        idx = where.nonzero().squeeze(1)[take]
        out[idx] = rows[take]
        best[idx] = p[take]
    return out
