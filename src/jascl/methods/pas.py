"""Prototype anchored supervision (PAS), paper eqs. 3-5, as pure functions on tensors.

For every unlabelled pixel/voxel and for each of student and teacher:
predicted class c' = argmax softmax, confidence = max softmax, and the cosine
similarity of the pixel's feature to the prototype of c' (eq. 3). A pseudo-label
is valid when conf > tau_conf and sim > tau_sim; the consistency loss (eq. 5)
is the mean squared difference of the student's and the teacher's softmax
outputs over the pixels valid for *both*.

Differences from the authors' code, on purpose: their consistency term is an
MSE between two hard, filtered label maps cast to float (no gradient reaches
the student), and their prototypes are looked up by position in a
concatenated dict. Here the loss is the paper's (soft, differentiable in the
student) and prototypes are looked up by class id (:func:`prototype_matrix`).
In their medical semi-supervised code the stored prototypes have shape
(D, 1, 1, 1), so after concatenation ``prototypes[c]`` is a single number and
the similarity becomes ``sign(x) * cos(f, 1)``: the prototype is never
consulted there (the natural-image code stores (1, D, 1, 1) and is not
affected). jascl keeps (D,) vectors per class and never reproduces that.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from jascl.engine.prototypes import PrototypeStore
from jascl.networks.base import resize


@dataclass
class PseudoLabels:
    """Per-pixel outputs of the PAS filter for one model.

    Shapes: (B, *spatial) for all fields; ``pred`` holds classifier rows.
    """

    pred: torch.Tensor
    conf: torch.Tensor
    sim: torch.Tensor
    valid: torch.Tensor


def select_anchors(anchors: torch.Tensor, limit: int) -> torch.Tensor:
    """At most ``limit`` of ``anchors`` (N, D), spread out: farthest-point selection by cosine.

    Starts from the anchor closest to the mean direction, then repeatedly adds
    the anchor least similar to those already chosen; deterministic. PAS's cost
    grows with the number of anchors (every pixel is compared with all of
    them), so a session with many labelled samples keeps a diverse subset.
    Returns ``anchors`` itself when it has at most ``limit`` rows.
    """
    if limit <= 0 or anchors.shape[0] <= limit:
        return anchors
    unit = F.normalize(anchors.float(), dim=1)
    chosen = [int((unit @ F.normalize(unit.mean(0), dim=0)).argmax())]
    closest = unit @ unit[chosen[0]]  # similarity of every anchor to its nearest chosen one
    while len(chosen) < limit:
        nxt = int(closest.argmin())
        chosen.append(nxt)
        closest = torch.maximum(closest, unit @ unit[nxt])
    return anchors[sorted(chosen)]


def prototype_matrix(
    seen: list[int], current: dict[int, torch.Tensor], store: PrototypeStore, dim: int, max_anchors: int = 0
) -> torch.Tensor:
    """(K, A, D) anchors aligned with the classifier rows ``seen`` (looked up by class id).

    The session's own prototypes (``current``: class id -> (D,) or (A_c, D), e.g.
    the per-sample prototypes of eq. 2) take precedence; otherwise the newest
    stored one. A = the largest anchor count (at most ``max_anchors`` per class when
    > 0, chosen by :func:`select_anchors`); shorter rows are padded with NaN
    anchors, and classes with no prototype get only NaN anchors (their
    similarity is NaN and their pixels invalid).
    """
    rows = []
    for c in seen:
        p = current.get(c)
        if p is None:
            p = store.latest(c)
        rows.append(
            select_anchors(p.float().reshape(-1, dim), max_anchors)
            if p is not None
            else torch.full((1, dim), float("nan"))
        )
    out = torch.full((len(rows), max(r.shape[0] for r in rows), dim), float("nan"))
    for k, r in enumerate(rows):
        out[k, : r.shape[0]] = r
    return out


#: bound on B x K x anchors x pixels of one block of dot products in :func:`best_anchor_similarity`
ANCHOR_BLOCK_ELEMENTS = 2**26


class AnchorGroups:
    """Anchors of every classifier row, grouped by how many each row has, ready for :func:`best_anchor_similarity`.

    Built once (e.g. per unlabelled phase) from (K, D) prototypes or (K, A, D)
    anchors whose NaN rows are padding after the real ones; the grouping is read on
    the host here, so that the per-step similarity never waits for a GPU.

    Args:
        prototypes: (K, D) or (K, A, D) tensor.
        device: where the grouped anchors go.
    """

    def __init__(self, prototypes: torch.Tensor, device: torch.device | str | None = None) -> None:
        p = F.normalize(prototypes.detach().float().cpu(), dim=-1)  # NaN anchors stay NaN
        if p.dim() == 2:
            p = p[:, None]
        self.k, _, self.dim = p.shape
        real = ~torch.isnan(p).any(-1)  # (K, A)
        counts = real.sum(1).tolist()
        device = device if device is not None else prototypes.device
        #: (anchors (rows, size, D), size) per group of rows with ``size`` real anchors, in row order per group
        self.groups: list[tuple[torch.Tensor, int]] = []
        position = [0] * self.k  # classifier row -> its index in the groups' concatenated rows
        placed = 0
        for size in sorted(set(counts) - {0}):
            rows = [c for c in range(self.k) if counts[c] == size]
            if not all(bool(real[c, :size].all()) for c in rows):
                raise ValueError("prototypes: every row's real anchors must come before its NaN padding")
            self.groups.append((p[rows][:, :size].contiguous().to(device), size))
            for i, c in enumerate(rows):
                position[c] = placed + i
            placed += len(rows)
        #: rows without any anchor point at one extra all-NaN row after the groups' rows
        self.missing = placed < self.k
        for c in range(self.k):
            if counts[c] == 0:
                position[c] = placed
        #: None when every row keeps its own index (one group, no row without anchors): no remapping per call
        self.position = (
            None if position == list(range(self.k)) else torch.tensor(position, dtype=torch.long, device=device)
        )


def best_anchor_similarity(
    features: torch.Tensor, anchors: AnchorGroups | torch.Tensor, pred: torch.Tensor
) -> torch.Tensor:
    """Cosine similarity of every pixel's feature to the best-matching anchor of its predicted class.

    Args:
        features: (B, D, *spatial) pixel features.
        anchors: :class:`AnchorGroups`, or a (K, D) / (K, A, D) tensor (grouped here; NaN anchors are padding).
        pred: (B, *spatial) predicted classifier rows.

    Returns:
        (B, *spatial) similarities; NaN where the predicted class has no anchor.

    Dot products are matrix products over D, divided by the pixel's norm at the
    end, so no (B, *spatial, D) copy is made. Classes are grouped by their number
    of anchors (typically the old classes have one stored prototype each and the
    session's classes several), so padding anchors cost nothing; each group is
    processed in blocks of anchors bounded by :data:`ANCHOR_BLOCK_ELEMENTS`. The
    groups' best dot products are concatenated and each pixel picks its class's
    row (a fixed remapping of the classifier rows, built with the groups), so a
    call launches a fixed, small number of kernels and reads nothing back to the host.
    """
    if not isinstance(anchors, AnchorGroups):
        anchors = AnchorGroups(anchors, features.device)
    flat = features.flatten(2)  # (B, D, N)
    batch, n = flat.shape[0], flat.shape[2]
    norms = torch.linalg.vector_norm(flat, dim=1).clamp_min(1e-12)  # (B, N); F.normalize's epsilon
    per_group: list[torch.Tensor] = []  # best dot product with each class's anchors, (B, rows of the group, N)
    for group, size in anchors.groups:
        best: torch.Tensor | None = None
        step = max(1, ANCHOR_BLOCK_ELEMENTS // max(group.shape[0] * batch * n, 1))
        for a0 in range(0, size, step):
            block = group[:, a0 : a0 + step].to(flat.dtype)
            dots = torch.matmul(block.reshape(-1, anchors.dim), flat)  # (B, k_g * c, N), contiguous
            dots = dots.view(batch, group.shape[0], block.shape[1], n).amax(2)
            best = dots if best is None else torch.maximum(best, dots)
        assert best is not None  # every group has at least one anchor (size >= 1)
        per_group.append(best)
    if anchors.missing:
        per_group.append(flat.new_full((batch, 1, n), float("nan")))
    per_class = per_group[0] if len(per_group) == 1 else torch.cat(per_group, 1)
    index = pred.reshape(batch, 1, n)
    if anchors.position is not None:
        index = anchors.position[index]
    sim = per_class.gather(1, index).squeeze(1) / norms  # NaN for a class without anchors
    return sim.view_as(pred)


def pas_filter(
    logits: torch.Tensor,
    features: torch.Tensor,
    prototypes: AnchorGroups | torch.Tensor | None,
    tau_conf: float,
    tau_sim: float,
    probs: torch.Tensor | None = None,
) -> PseudoLabels:
    """The PAS validity test (eqs. 3-4) for one model.

    Args:
        logits: (B, K, *spatial) classifier outputs.
        features: (B, D, *spatial') features before the classifier (resized to
            the logits' size if they differ).
        prototypes: (K, D) prototype per classifier row, or (K, A, D) anchors per
            row (NaN anchors are ignored; sim is the best-matching anchor's), or those
            as :class:`AnchorGroups` (built once, no host synchronisation per call), or
            None for the confidence-only filter (sim is then +1 everywhere).
        tau_conf, tau_sim: thresholds; a pixel is valid iff conf > tau_conf and sim > tau_sim.
        probs: ``softmax(logits.float(), 1)`` if the caller has it already (e.g. for the consistency loss).
    """
    if probs is None:
        probs = torch.softmax(logits.float(), dim=1)
    conf, pred = probs.max(dim=1)
    if prototypes is None:
        sim = torch.ones_like(conf)
    else:
        features = resize(features, logits.shape[2:])
        sim = best_anchor_similarity(features.float(), prototypes, pred)
    valid = (conf > tau_conf) & (sim > tau_sim)  # NaN similarity compares False
    return PseudoLabels(pred, conf, sim, valid)


def consistency_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Eq. 5: mean over valid pixels of || softmax(student) - softmax(teacher) ||_2^2.

    The teacher side is detached. An empty valid set gives 0 (still attached to
    the student's graph, so ``backward`` works) instead of NaN.

    Args:
        student_logits, teacher_logits: (B, K, *spatial).
        valid: (B, *spatial) bool, pixels valid for both models.
    """
    return consistency_loss_probs(
        torch.softmax(student_logits.float(), dim=1), torch.softmax(teacher_logits.detach().float(), dim=1), valid
    )


def consistency_loss_probs(
    student_probs: torch.Tensor, teacher_probs: torch.Tensor, valid: torch.Tensor
) -> torch.Tensor:
    """:func:`consistency_loss` from the two softmax outputs, (B, K, *spatial) each (the teacher's is detached)."""
    per_pixel = ((student_probs - teacher_probs.detach()) ** 2).sum(dim=1)
    # no branch on the count: testing it would wait for the GPU at every step
    return (per_pixel * valid).sum() / valid.sum().clamp_min(1)


@dataclass(frozen=True)
class FilterStats:
    """Host-side counts of one filter, read from :class:`FilterCounters`.

    ``by_class[c]`` = (kept pixels with unknown truth, kept and wrong, kept and right)
    for pseudo-label class c (global id).
    """

    total: int
    by_class: tuple[tuple[int, int, int], ...]

    @property
    def kept(self) -> int:
        return sum(sum(row) for row in self.by_class)

    @property
    def evaluated(self) -> int:
        """Kept pixels with known ground truth."""
        return sum(row[1] + row[2] for row in self.by_class)

    @property
    def correct(self) -> int:
        return sum(row[2] for row in self.by_class)

    @property
    def coverage(self) -> float:
        return self.kept / self.total if self.total else float("nan")

    @property
    def precision(self) -> float:
        return self.correct / self.evaluated if self.evaluated else float("nan")

    def per_class(self) -> dict[int, tuple[int, float]]:
        """Pseudo-label class -> (kept pixels with known truth, precision among them)."""
        return {
            c: (row[1] + row[2], row[2] / (row[1] + row[2])) for c, row in enumerate(self.by_class) if row[1] + row[2]
        }


@dataclass
class FilterCounters:
    """Counts for coverage f and precision rho of kept pseudo-labels against hidden ground truth.

    Holds ``filters`` filters applied to the same predictions (e.g. PAS and the
    confidence-only test, each also restricted to foreground), counted together:
    one (filters, 256 classes, 3) integer tensor on the predictions' device, where the
    3 counts of a pseudo-label class are kept pixels whose truth is unknown, kept and
    wrong, kept and right. An update is one scatter-add for all filters and never
    waits for the device; :meth:`stats` reads one filter's counts.

    Args:
        filters: number of filters counted side by side.
    """

    filters: int = 1
    total: int = 0  # pixels seen, per filter
    counts: torch.Tensor | None = None  # (filters, 256 * 3) int64

    def update(self, valid: torch.Tensor, pred_ids: torch.Tensor, truth: torch.Tensor | None) -> None:
        """Count one batch.

        Args:
            valid: (*P) bool kept-mask for one filter, or (filters, *P) for all of them.
            pred_ids: (*P) pseudo-labels as global class ids (< 255).
            truth: (*P) global class ids, 255 = unknown; None = all unknown.
        """
        n = pred_ids.numel()
        if valid.numel() != self.filters * n:
            raise ValueError(f"valid has {valid.numel()} elements; expected {self.filters} filter(s) x {n} pixels")
        self.total += n
        if self.counts is None:
            self.counts = torch.zeros(self.filters, 256 * 3, dtype=torch.long, device=pred_ids.device)
        elif self.counts.device != pred_ids.device:  # e.g. restored from a checkpoint onto the CPU
            self.counts = self.counts.to(pred_ids.device)
        index = pred_ids.reshape(-1).long() * 3
        if truth is not None:
            truth = truth.reshape(-1)
            index = index + (truth != 255) + (pred_ids.reshape(-1) == truth)  # 0 unknown, 1 wrong, 2 right
        self.counts.scatter_add_(1, index.expand(self.filters, n), valid.reshape(self.filters, n).long())

    def stats(self, f: int = 0) -> FilterStats:
        """Filter ``f``'s counts on the host (one device read)."""
        if self.counts is None:
            return FilterStats(int(self.total), ())
        rows = self.counts[f].view(256, 3).tolist()
        return FilterStats(int(self.total), tuple(tuple(r) for r in rows))

    def all_reduce(self) -> None:
        """Sum the counts of all ranks; no-op in one process."""
        from jascl.distributed import active, all_reduce_sum

        if not active():
            return
        self.total = int(all_reduce_sum(torch.tensor([int(self.total)]))[0])
        counts = self.counts if self.counts is not None else torch.zeros(self.filters, 256 * 3, dtype=torch.long)
        self.counts = all_reduce_sum(counts)


def pool_pseudo_label_report(
    pool_labels: Any, pseudo_rows: torch.Tensor, seen: list[int], method: str, rounds: int
) -> dict:
    """``state.report["pseudo_labels"]`` of a method that pseudo-labels the unlabelled pool once per round
    (UaD-CE, FSCIL-SS, HALO): coverage and precision of its kept pseudo-labels against the pool's hidden truth.

    Args:
        pool_labels: the pool's labels, global ids (measurement only; they never enter a loss): an (N, *spatial)
            array, or a lazy split's labels of one shape (the pool's crops), indexed sample by sample.
        pseudo_rows: (N, *spatial) classifier rows chosen per pool pixel, 255 where none is.
        seen: the session's classifier rows as global class ids.
        method: the method's name, recorded with the counts.
        rounds: selection rounds run.
    """
    import numpy as np

    from jascl.protocols.schema import IGNORE_INDEX

    # sample by sample: a real dataset's pool is lazy (its samples are read one at a time, and are not one array)
    truth = torch.from_numpy(np.stack([np.asarray(pool_labels[i]) for i in range(len(pool_labels))]).astype("int64"))
    ids = torch.as_tensor(seen)[pseudo_rows.clamp(max=len(seen) - 1)]
    counters = FilterCounters()
    counters.update(pseudo_rows != IGNORE_INDEX, ids, truth)
    stats = counters.stats()
    return {"method": method, "rounds": rounds, "coverage": stats.coverage, "precision": stats.precision}


def asymptotic_error(f: float, rho: float, gamma: float, eps0: float) -> float:
    """Theorem "Asymptotic Error With PAS": eps_inf = (1 - f*gamma) * eps0 / (1 - f*gamma*(1 - rho)).

    Args:
        f: coverage (fraction of pseudo-labels kept).
        rho: precision of the kept pseudo-labels.
        gamma: weight of pseudo-labels in the student's training signal, in (0, 1).
        eps0: error rate with labelled data only.
    """
    return (1.0 - f * gamma) * eps0 / (1.0 - f * gamma * (1.0 - rho))


class EMAPairs:
    """The floating tensors of a teacher and of a student, paired by name, for repeated EMA steps.

    Built once per session (the tensors share storage with both models, so each
    step reads the student's current values); :meth:`step` is one fused
    multi-tensor update instead of two kernels per tensor.

    Args:
        teacher: the EMA model.
        student_state: a clean state dict of the student (same keys as the teacher's).
        buffers: also average the floating buffers (BatchNorm running statistics) and copy the integer ones;
            False: parameters only, the teacher's buffers left as they are (the authors' ``update_teacher``).
    """

    def __init__(self, teacher: torch.nn.Module, student_state: dict[str, torch.Tensor], buffers: bool = True) -> None:
        own = teacher.state_dict()
        if not buffers:
            names = {name for name, _ in teacher.named_parameters()}
            own = {k: v for k, v in own.items() if k in names}
        self.teacher = [t for t in own.values() if t.dtype.is_floating_point]
        self.student = [student_state[k] for k, t in own.items() if t.dtype.is_floating_point]
        self.teacher_other = [t for t in own.values() if not t.dtype.is_floating_point]
        self.student_other = [student_state[k] for k, t in own.items() if not t.dtype.is_floating_point]
        self._cast = any(s.dtype != t.dtype for s, t in zip(self.student, self.teacher))

    @torch.no_grad()
    def step(self, decay: float) -> None:
        """teacher <- decay * teacher + (1 - decay) * student; integer buffers are copied."""
        if self.teacher:
            student = [s.to(t) for s, t in zip(self.student, self.teacher)] if self._cast else self.student
            torch._foreach_lerp_(self.teacher, student, 1.0 - decay)
        if self.teacher_other:
            torch._foreach_copy_(self.teacher_other, self.student_other)


@torch.no_grad()
def ema_update(teacher: torch.nn.Module, student_state: dict[str, torch.Tensor], decay: float) -> None:
    """teacher <- decay * teacher + (1 - decay) * student, for every floating parameter and buffer.

    ``student_state`` is a clean state dict of the student (same keys as the teacher's).
    """
    EMAPairs(teacher, student_state).step(decay)
