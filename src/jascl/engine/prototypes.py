"""Class prototypes (paper eq. 2) and the cumulative prototype store.

Eq. 2: for each labelled sample i containing class c, the per-sample prototype
is the mean of the features where the label is c; it is L2-normalised, and the
class prototype P_c is the average of those over the samples containing c.
Background (class 0) gets a prototype like any other class.

Prototypes are kept per (session, class) so that a class taught in several
domains keeps one anchor per domain, and a session's background has its own.
They are looked up by class id, never by position, and stored as safetensors.

The *complement* of class c (``complement=True``) is eq. 2 applied to the pixels
of c's samples that are not c (every other class and background, ignore pixels
excluded), over the samples that contain both c and something else: the
per-class background prototype of the authors' replay store
(``methods/utils.py:get_prototype(..., background=True)``), used by
:class:`jascl.methods.replay.PrototypeReplayPlugin` with ``background="per-class"``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from jascl.errors import CheckpointError
from jascl.fileio import atomic_write
from jascl.networks.ops import unit_channels
from jascl.protocols.schema import IGNORE_INDEX


def align_labels(labels: torch.Tensor, spatial: Sequence[int]) -> torch.Tensor:
    """Nearest-neighbour resize of (B, *spatial) integer labels to ``spatial`` (e.g. a feature map's size);
    ``labels`` itself when it has that size already."""
    if tuple(labels.shape[1:]) == tuple(spatial):
        return labels
    return F.interpolate(labels[:, None].float(), size=tuple(spatial), mode="nearest")[:, 0].long()


FORMS = ("eq2", "authors")


def _class_pixels(labels: torch.Tensor, c: int, authors: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(c's pixels, the other pixels) of flat labels: ignore pixels count as "other" only in the authors' form."""
    mask = labels == c
    other = labels != c
    if not authors:
        other = other & (labels != IGNORE_INDEX)
    return mask, other


def per_sample_prototypes(
    features: torch.Tensor,
    labels: torch.Tensor,
    classes: list[int],
    normalize_pixels: bool = False,
    complement: bool = False,
    form: str = "eq2",
) -> dict[int, list[torch.Tensor]]:
    """Per-sample normalised prototypes p_c^(i)/|p_c^(i)| (the summands of eq. 2).

    Args:
        features: (B, D, *spatial) features before the classifier.
        labels: (B, *spatial) global class ids (resized to the features if needed).
        classes: class ids to collect (0 = background may be included).
        normalize_pixels: L2-normalise every pixel's feature before the per-sample
            mean, so that each pixel counts once in the prototype's *direction*;
            False is eq. 2 literally, where pixels with large feature norms dominate
            the mean. The authors' code (``get_prototype``) also normalises the
            pixels, but then averages them over all images of the class without
            normalising each image's mean; here each per-sample mean is still
            normalised (eq. 2's p_c^(i)/|p_c^(i)|), so the two agree within one
            image and differ when a class spans several.
        complement: for class c, average the pixels of c's samples that are *not* c
            (ignore pixels excluded) instead of those that are; a sample counts when it
            has both (the module docstring's per-class background).
        form: "eq2" (above) or "authors" (the module docstring: unit pixels, sample means not
            renormalised, ignore pixels in the complement, only samples with both c and not-c pixels).

    Returns:
        class id -> list of (D,) vectors, one per sample containing the class (unit vectors with "eq2").
    """
    if form not in FORMS:
        raise ValueError(f"prototype form must be one of {', '.join(FORMS)}, got {form!r}")
    authors = form == "authors"
    labels = align_labels(labels, features.shape[2:])
    if normalize_pixels or authors:
        features = unit_channels(features)
    out: dict[int, list[torch.Tensor]] = {c: [] for c in classes}
    flat = features.flatten(2)  # (B, D, N)
    lab = labels.flatten(1)  # (B, N)
    for b in range(features.shape[0]):
        for c in classes:
            mask, other = _class_pixels(lab[b], c, authors)
            if not mask.any() or ((complement or authors) and not other.any()):
                continue
            mean = flat[b][:, other if complement else mask].mean(dim=1)
            out[c].append(mean if authors else F.normalize(mean, dim=0))
    return out


def sample_sums(
    features: torch.Tensor,
    labels: torch.Tensor,
    classes: list[int],
    normalize_pixels: bool = False,
    complement: bool = False,
    form: str = "eq2",
) -> dict[int, tuple[torch.Tensor, int, int, int]]:
    """:func:`per_sample_prototypes` of one sample, or of one piece of it, as sums that add up over pieces.

    Args:
        features: (1, D, *spatial) features of the piece (at the labels' resolution).
        labels: (1, *spatial) global class ids.
        classes, normalize_pixels, complement, form: as :func:`per_sample_prototypes`.

    Returns:
        class id -> (sum of the averaged pixels' features (D,), their count, c's pixels, the other pixels) for the
        classes with any averaged pixel; summed over a sample's pieces, :func:`prototypes_from_sums` gives
        :func:`per_sample_prototypes` of the whole sample.
    """
    if features.shape[0] != 1 or tuple(labels.shape[1:]) != tuple(features.shape[2:]):
        raise ValueError(f"one sample at the labels' resolution (got {tuple(features.shape)}, {tuple(labels.shape)})")
    if form not in FORMS:
        raise ValueError(f"prototype form must be one of {', '.join(FORMS)}, got {form!r}")
    authors = form == "authors"
    if normalize_pixels or authors:
        features = unit_channels(features)
    flat, lab = features.flatten(2)[0], labels.flatten(1)[0]
    out = {}
    for c in classes:
        mask, other = _class_pixels(lab, c, authors)
        selected = other if complement else mask
        n_mask, n_other, n_selected = int(mask.sum()), int(other.sum()), int(selected.sum())
        if n_mask or n_other:
            out[c] = (flat[:, selected].sum(dim=1), n_selected, n_mask, n_other)
    return out


def prototypes_from_sums(
    sums: dict[int, tuple[torch.Tensor, int, int, int]], complement: bool = False, form: str = "eq2"
) -> dict[int, torch.Tensor]:
    """One sample's prototypes from its pieces' :func:`sample_sums`, added up: the mean of the averaged pixels,
    L2-normalised with ``form="eq2"``; a class is left out as :func:`per_sample_prototypes` leaves it out."""
    authors = form == "authors"
    out = {}
    for c, (total, n_selected, n_mask, n_other) in sums.items():
        if not n_mask or ((complement or authors) and not n_other):
            continue
        mean = total / n_selected
        out[c] = mean if authors else F.normalize(mean, dim=0)
    return out


def class_prototypes(
    features: torch.Tensor,
    labels: torch.Tensor,
    classes: list[int],
    normalize_pixels: bool = False,
    complement: bool = False,
    form: str = "eq2",
) -> dict[int, torch.Tensor]:
    """Eq. 2 on one batch: P_c = mean over samples containing c of the normalised per-sample means
    (of c's complement with ``complement``; the authors' values with ``form="authors"``)."""
    return {
        c: torch.stack(v).mean(0)
        for c, v in per_sample_prototypes(features, labels, classes, normalize_pixels, complement, form).items()
        if v
    }


class PrototypeAccumulator:
    """Streams eq. 2 over many batches (sums of normalised per-sample prototypes and counts).

    ``keep_samples``: also keep every per-sample prototype, for :meth:`samples`;
    ``complement``: prototypes of each class's complement; ``form``: "eq2" or "authors" (see
    :func:`per_sample_prototypes`).
    """

    def __init__(
        self,
        classes: list[int],
        normalize_pixels: bool = False,
        keep_samples: bool = False,
        complement: bool = False,
        form: str = "eq2",
    ) -> None:
        self.classes = classes
        self.normalize_pixels = normalize_pixels
        self.complement = complement
        self.form = form
        self.sums: dict[int, torch.Tensor] = {}
        self.counts: dict[int, int] = {c: 0 for c in classes}
        self.vectors: dict[int, list[torch.Tensor]] | None = {c: [] for c in classes} if keep_samples else None
        #: the sample :meth:`add_piece` is collecting: class id -> (sum, averaged pixels, c's pixels, others)
        self._pending: dict[int, tuple[torch.Tensor, int, int, int]] = {}

    @torch.no_grad()
    def update(self, features: torch.Tensor, labels: torch.Tensor) -> None:
        for c, vectors in per_sample_prototypes(
            features.float(), labels, self.classes, self.normalize_pixels, self.complement, self.form
        ).items():
            if vectors:
                s = torch.stack(vectors).sum(0).cpu()
                self.sums[c] = self.sums[c] + s if c in self.sums else s
                self.counts[c] += len(vectors)
                if self.vectors is not None:
                    self.vectors[c].extend(v.cpu() for v in vectors)

    @torch.no_grad()
    def add_piece(self, features: torch.Tensor, labels: torch.Tensor) -> None:
        """One piece of one sample (B = 1; a block of a volume whose features are not held whole): its sums are
        kept until :meth:`end_sample`, which adds the sample as :meth:`update` would have."""
        pending = self._pending
        for c, (total, n, n_mask, n_other) in sample_sums(
            features.float(), labels, self.classes, self.normalize_pixels, self.complement, self.form
        ).items():
            if c in pending:
                t0, n0, m0, o0 = pending[c]
                pending[c] = (t0 + total, n0 + n, m0 + n_mask, o0 + n_other)
            else:
                pending[c] = (total, n, n_mask, n_other)

    def end_sample(self) -> None:
        """Add the sample whose pieces :meth:`add_piece` collected."""
        for c, vector in prototypes_from_sums(self._pending, self.complement, self.form).items():
            s = vector.cpu()
            self.sums[c] = self.sums[c] + s if c in self.sums else s
            self.counts[c] += 1
            if self.vectors is not None:
                self.vectors[c].append(s)
        self._pending = {}

    def all_reduce(self, dim: int) -> None:
        """Sum sums and counts over ranks (each saw a share of the samples); no-op in one process."""
        from jascl import distributed

        if not distributed.active():
            return
        table = torch.zeros(len(self.classes), dim + 1, dtype=torch.float64)
        for i, c in enumerate(self.classes):
            if c in self.sums:
                table[i, :dim] = self.sums[c].double()
            table[i, dim] = self.counts[c]
        table = distributed.all_reduce_sum(table)
        self.sums = {c: table[i, :dim].float() for i, c in enumerate(self.classes) if table[i, dim] > 0}
        self.counts = {c: int(table[i, dim]) for i, c in enumerate(self.classes)}
        if self.vectors is not None:  # per-sample prototypes: every rank's, in rank order
            gathered = distributed.all_gather_object(self.vectors)
            self.vectors = {c: [v for part in gathered for v in part[c]] for c in self.classes}

    def compute(self) -> dict[int, torch.Tensor]:
        """Eq. 2: class id -> (D,) mean of the per-sample prototypes."""
        return {c: self.sums[c] / self.counts[c] for c in self.classes if self.counts[c]}

    def samples(self) -> dict[int, torch.Tensor]:
        """The summands of eq. 2: class id -> (N_c, D) per-sample prototypes (unit vectors with ``form="eq2"``),
        in the order the samples were seen; needs ``keep_samples``."""
        if self.vectors is None:
            raise RuntimeError("PrototypeAccumulator(keep_samples=False) does not keep per-sample prototypes")
        return {c: torch.stack(v) for c, v in self.vectors.items() if v}


@dataclass(frozen=True)
class PrototypeRequest:
    """One ``compute_prototypes`` call as a value (:meth:`jascl.engine.loop.ContinualTrainer.compute_prototypes`):
    the classes and options. Several requests can be served by one pass over a session's data
    (:meth:`jascl.engine.tasks.Task.compute_prototype_requests`), each with its own accumulator."""

    classes: tuple[int, ...]
    normalize_pixels: bool = False
    per_sample: bool = False
    complement: bool = False
    form: str = "eq2"

    def accumulator(self) -> PrototypeAccumulator:
        """A fresh accumulator for this request."""
        return PrototypeAccumulator(
            list(self.classes), self.normalize_pixels, self.per_sample, self.complement, self.form
        )

    def result(self, acc: PrototypeAccumulator) -> dict[int, torch.Tensor]:
        """What ``compute_prototypes`` returns for this request once ``acc`` has seen every sample: per-sample
        prototypes (N_c, D) with ``per_sample``, else the class prototypes (D,)."""
        return acc.samples() if self.per_sample else acc.compute()


@dataclass
class PrototypeStore:
    """All prototypes collected so far, keyed by (session, class id)."""

    entries: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)

    def add(self, session: int, prototypes: dict[int, torch.Tensor]) -> None:
        for c, p in prototypes.items():
            self.entries[(session, int(c))] = p.detach().float().cpu()

    def before(self, session: int) -> PrototypeStore:
        """Entries from sessions strictly earlier than ``session``."""
        return PrototypeStore({k: v for k, v in self.entries.items() if k[0] < session})

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(N, D) prototypes and (N,) their class ids, in (session, class) order."""
        keys = sorted(self.entries)
        if not keys:
            return torch.zeros(0, 0), torch.zeros(0, dtype=torch.long)
        return torch.stack([self.entries[k] for k in keys]), torch.tensor([k[1] for k in keys])

    def latest(self, class_id: int) -> torch.Tensor | None:
        """The most recent prototype of ``class_id`` (looked up by class id)."""
        keys = sorted(k for k in self.entries if k[1] == class_id)
        return self.entries[keys[-1]] if keys else None

    def __len__(self) -> int:
        return len(self.entries)

    def save(self, path: str | Path) -> None:
        """Atomic safetensors write; keys are ``s<session>.c<class>``."""
        path = Path(path)
        tensors = {f"s{s}.c{c}": v.contiguous() for (s, c), v in self.entries.items()}
        atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata={"format": "jascl-prototypes-v1"}))

    @classmethod
    def load(cls, path: str | Path) -> PrototypeStore:
        try:
            raw = load_file(str(path))
        except Exception as exc:  # safetensors raises several error types for bad files
            raise CheckpointError(
                f"{path}: cannot read prototypes ({exc}); delete the file and rerun the session"
            ) from None
        entries = {}
        for key, value in raw.items():
            s, c = key.split(".")
            entries[(int(s[1:]), int(c[1:]))] = value
        return cls(entries)
