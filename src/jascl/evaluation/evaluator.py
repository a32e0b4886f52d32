"""Evaluation of a segmenter over all classes seen so far.

Two modes (``RunConfig.eval_mode``):

* ``sliding-window`` (default): whole images / volumes through MONAI's
  sliding-window inference with the training patch as ROI; per-class Dice and
  IoU from a confusion matrix accumulated over the whole test set; means over
  foreground classes (background reported separately).
* ``authors``: what the paper's tables were computed with in the authors'
  code: one crop per test volume centred on the ground-truth foreground (with
  seeded jitter), soft Dice per class on softmax outputs.

In both modes the all-class mean is taken over the seen *foreground* classes, as the
paper's class-wise tables average them: their "Average" rows equal the mean of the
class rows without ``class_0`` (e.g. Gen-Replay 0.700, MDIL 0.779, C-FSCIL 0.787,
NNCSL 0.700, SwinUNETR 0.596; ``tests/test_paper_tables.py`` checks every table).
The authors' code counts background in its mean; ``RunConfig.background_in_mean``
does that. A few tables fit neither convention (Med-Disjoint U-Net session 0: the
class rows give 0.755 without background and 0.769 with it, the table prints 0.736);
``jascl/paper/tables/*.yaml`` records them in their notes.

Evaluation is deterministic (GAS noise off) unless ``eval_mc_samples`` > 0,
in which case softmax outputs are averaged over that many GAS noise draws.

Memory: MONAI's sliding-window inference stitches a ``(B, K, *spatial)`` float32
output for the whole input: 315 MB per class for a 512 x 512 x 300 CT (5 GB for 16). A
sample larger than ``max_block_elements`` allows is therefore processed in
blocks (:func:`plan_blocks`): each block is the union of a contiguous run of
MONAI's own windows along every axis, and it is scored only on the voxels all
of whose windows it contains. Every scored voxel thus receives exactly the
windows, weights and accumulation order it would in one whole-volume pass, so
the predictions (and the confusion counts) are those of the unbounded pass; the
price is that windows on block borders are evaluated by both neighbours.
Samples of different shapes in one split are scored one shape-group at a time.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from monai.inferers import sliding_window_inference

from jascl import distributed
from jascl.data.types import Split
from jascl.evaluation.metrics import ConfusionAccumulator, dice_from_confusion, iou_from_confusion
from jascl.networks.base import Segmenter

#: default bound on B x K x voxels of one stitched sliding-window output (float32: 2 GiB). A 512 x 512 x 300
#: CT with 16 classes then takes 4 blocks and 256 window evaluations instead of 196 (2 ** 28: 14 blocks, 416)
MAX_BLOCK_ELEMENTS = 2**29
#: voxels per confusion-matrix update (its int64 temporaries cost ~60 bytes per voxel)
CONFUSION_CHUNK = 2**22


@dataclass
class EvalResult:
    """Per-class scores keyed by global class id (NaN = class absent from the test data), and their support.

    ``support``: pixels / voxels of each class in the scored ground truth (ignore excluded; in ``authors``
    mode, inside the crops); ``samples``: test samples whose scored ground truth contains the class. A
    score resting on few voxels or one sample is a weak finding; reports show both beside it.
    """

    dice: dict[int, float]
    iou: dict[int, float]
    support: dict[int, int] = field(default_factory=dict)
    samples: dict[int, int] = field(default_factory=dict)

    def metric(self, name: str) -> dict[int, float]:
        return self.dice if name == "dice" else self.iou


@contextlib.contextmanager
def monte_carlo(model: Segmenter, enabled: bool) -> Iterator[None]:
    """Temporarily switch a model's sampling modules on in an otherwise eval-mode model (Monte-Carlo evaluation).

    A sampling module is any module with a true class attribute ``monte_carlo`` (e.g. GAS noise,
    :class:`jascl.methods.gas.GASNoise`): it samples in training mode and is deterministic in eval mode.
    """
    modules = [m for m in model.modules() if getattr(m, "monte_carlo", False)] if enabled else []
    for m in modules:
        m.train(True)
    try:
        yield
    finally:
        for m in modules:
            m.train(False)


# ------------------------------------------------------------------------------------------------------------------
# memory-bounded sliding window: blocks made of MONAI's own windows


def window_starts(size: int, roi: int, overlap: float) -> list[int]:
    """Start of every window MONAI's ``sliding_window_inference`` places along one axis.

    Reproduces MONAI's grid (``_get_scan_interval`` + ``dense_patch_slices``):
    interval ``int(roi * (1 - overlap))`` (at least 1; ``roi`` when the axis is
    exactly ``roi`` long), windows at multiples of the interval until one reaches
    the end, the last one shifted back to end at ``size``. An axis shorter than
    ``roi`` is padded by MONAI and holds one window.
    """
    if size <= roi:
        return [0]
    interval = max(int(roi * (1 - overlap)), 1)
    count = next(d for d in range(size) if d * interval + roi >= size) + 1
    return [min(d * interval, size - roi) for d in range(count)]


@dataclass(frozen=True)
class Block:
    """One piece of a blocked sliding-window pass.

    Attributes:
        source: the input region (global spatial slices) given to ``sliding_window_inference``.
        target: the region whose predictions are kept (global slices, inside ``source``).
    """

    source: tuple[slice, ...]
    target: tuple[slice, ...]

    @property
    def local(self) -> tuple[slice, ...]:
        """``target`` in ``source``'s coordinates."""
        return tuple(slice(t.start - s.start, t.stop - s.start) for s, t in zip(self.source, self.target))


def _axis_chunks(size: int, roi: int, overlap: float, per_chunk: int) -> list[tuple[slice, slice]]:
    """(source, target) ranges along one axis, ``per_chunk`` windows owned per chunk.

    A chunk owns the voxels from its first window's start to the next chunk's;
    its source spans every window touching those voxels, so the windows MONAI
    places on the source are exactly these global windows.
    """
    starts = window_starts(size, roi, overlap)
    if len(starts) == 1:
        return [(slice(0, size), slice(0, size))]
    bounds = [starts[g] for g in range(0, len(starts), per_chunk)] + [size]
    bounds[0] = 0
    chunks = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        needed = [s for s in starts if s < b and s + roi > a]
        chunks.append((slice(min(needed), max(needed) + roi), slice(a, b)))
    return chunks


def _axis_options(size: int, roi: int, overlap: float) -> list[tuple[int, int, list[tuple[slice, slice]]]]:
    """Every way to chunk one axis as (largest source length, windows evaluated, chunks)."""
    count = len(window_starts(size, roi, overlap))
    options, seen = [], set()
    for pieces in range(1, count + 1):
        per_chunk = math.ceil(count / pieces)
        if per_chunk in seen:
            continue
        seen.add(per_chunk)
        chunks = _axis_chunks(size, roi, overlap, per_chunk)
        windows = (
            sum(
                len([s for s in window_starts(size, roi, overlap) if src.start <= s < src.stop - roi + 1])
                for src, _ in chunks
            )
            if count > 1
            else 1
        )
        options.append((max(src.stop - src.start for src, _ in chunks), windows, chunks))
    return options


def plan_blocks(
    spatial: Sequence[int], roi: Sequence[int], overlap: float, elements_per_voxel: int, max_elements: int | None
) -> list[Block]:
    """Split a sliding-window pass over ``spatial`` into blocks of bounded output size.

    Among all per-axis chunkings of MONAI's window grid, picks the one that
    evaluates the fewest windows (then: fewest blocks) while every block's
    stitched output, ``elements_per_voxel`` (B x K) times its source voxels, stays
    within ``max_elements``. If even one-window chunks exceed it, those are used.

    Args:
        spatial: the sample's spatial shape.
        roi: the sliding-window ROI.
        overlap: MONAI's ``overlap``.
        elements_per_voxel: stitched-output elements per voxel (batch x classes).
        max_elements: the bound; None = one block (the unbounded pass).

    Returns:
        Blocks whose targets tile ``spatial`` exactly.
    """
    whole = tuple(slice(0, int(n)) for n in spatial)
    if max_elements is None or elements_per_voxel * math.prod(spatial) <= max_elements:
        return [Block(whole, whole)]
    per_axis = [_axis_options(int(n), int(r), overlap) for n, r in zip(spatial, roi)]
    best, best_key = None, None
    for combo in itertools.product(*per_axis):
        fits = elements_per_voxel * math.prod(length for length, _, _ in combo) <= max_elements
        key = (not fits, math.prod(w for _, w, _ in combo), math.prod(len(c) for _, _, c in combo))
        if best_key is None or key < best_key:
            best, best_key = combo, key
    if best_key[0]:  # nothing fits: the finest chunking on every axis
        best = [options[-1] for options in per_axis]
    return [
        Block(tuple(src for src, _ in parts), tuple(tgt for _, tgt in parts))
        for parts in itertools.product(*(chunks for _, _, chunks in best))
    ]


# ------------------------------------------------------------------------------------------------------------------
# scoring


def _softmax_mean(run: Callable[[], torch.Tensor], mc_samples: int) -> torch.Tensor:
    """Mean softmax over ``mc_samples`` GAS noise draws of ``run`` (a running sum, not a stack of draws)."""
    total = torch.softmax(torch.as_tensor(run()).float(), dim=1)
    for _ in range(mc_samples - 1):
        total += torch.softmax(torch.as_tensor(run()).float(), dim=1)
    return total / mc_samples


def _probabilities(model: Segmenter, x: torch.Tensor, mc_samples: int) -> torch.Tensor:
    """(B, K, *spatial) softmax of one whole-input forward (averaged over GAS draws when mc_samples > 0)."""
    if mc_samples <= 0:
        return torch.softmax(torch.as_tensor(model(x)).float(), dim=1)
    with monte_carlo(model, True):
        return _softmax_mean(lambda: model(x), mc_samples)


def class_rows(scores: torch.Tensor) -> torch.Tensor:
    """(B, *spatial) index along dim 1 of each voxel's highest score: the first on ties, as ``argmax``.

    ``torch.max(scores, 1).indices`` gives the same indices as ``scores.argmax(1)``, about 6 times faster on a
    CPU for class scores of this layout (4 x 7 x 512 x 512 float32, one thread, torch 2.14: 23.5 against 141.8
    ms), where the argmax reduces across a strided dimension.
    """
    return torch.max(scores, dim=1).indices


def _block_scores(
    model: Segmenter, x: torch.Tensor, roi: Sequence[int], sw_batch: int, overlap: float, mc_samples: int
) -> torch.Tensor:
    """(B, K, *block) scores whose argmax is the prediction: stitched logits, or mean softmax under MC-GAS.

    The deterministic pass skips the softmax: it is monotonic per voxel, so the
    argmax is the same, and it would cost another K-channel volume.
    """

    def once() -> torch.Tensor:
        return torch.as_tensor(sliding_window_inference(x, list(roi), sw_batch, model, overlap=overlap))

    if mc_samples <= 0:
        return once().float()
    with monte_carlo(model, True):
        return _softmax_mean(once, mc_samples)


def _centred_crop(label: np.ndarray, size: Sequence[int], rng: np.random.Generator) -> tuple[slice, ...]:
    """A crop of ``size`` centred near the foreground centroid, with up to 10% jitter."""
    fg = np.argwhere(label > 0)
    centre = fg.mean(0) if len(fg) else np.array(label.shape) / 2
    slices = []
    for c, s, n in zip(centre, size, label.shape):
        s = min(s, n)
        c = c + rng.uniform(-0.1, 0.1) * s
        start = int(np.clip(round(c - s / 2), 0, n - s))
        slices.append(slice(start, start + s))
    return tuple(slices)


class _Indexed:
    """``items[indices[i]]`` as item ``i``."""

    def __init__(self, items, indices: list[int]) -> None:
        self.items, self.indices = items, indices

    def __getitem__(self, i: int):
        return self.items[self.indices[i]]

    def __len__(self) -> int:
        return len(self.indices)


class _Shard:
    """This rank's share of a split's samples (every ``world_size``-th); the split itself in one process."""

    def __init__(self, split: Split) -> None:
        self.indices = distributed.shard(range(len(split)))
        self.images = _Indexed(split.images, self.indices)
        self.labels = _Indexed(split.labels, self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def _shape_groups(split: _Shard, batch_size: int) -> Iterator[tuple[list[int], list[np.ndarray], list[np.ndarray]]]:
    """Consecutive samples of one shape, at most ``batch_size`` at a time, with their indices in the split.

    Samples are fetched one by one (``split.images[i]``), so a lazily loading
    split with volumes of different sizes works; a sample whose shape differs
    from the previous one starts a new batch.
    """
    indices: list[int] = []
    images: list[np.ndarray] = []
    labels: list[np.ndarray] = []
    for i in range(len(split)):
        image, label = np.asarray(split.images[i]), np.asarray(split.labels[i])
        if images and (len(images) == batch_size or image.shape != images[0].shape):
            yield indices, images, labels
            indices, images, labels = [], [], []
        indices.append(split.indices[i])
        images.append(image)
        labels.append(label)
    if images:
        yield indices, images, labels


def _stack(arrays: list[np.ndarray]) -> np.ndarray:
    return np.ascontiguousarray(arrays[0][None]) if len(arrays) == 1 else np.stack(arrays)


def _presence(label: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """(K,) 0/1: which of the global class ids ``ids`` occur in ``label`` (counted in chunks: no int64 copy of a
    whole CT volume)."""
    flat = label.reshape(-1)
    found = np.zeros(max(int(ids.max()) + 1, 1), dtype=bool)
    for start in range(0, flat.size, CONFUSION_CHUNK):
        counts = np.bincount(flat[start : start + CONFUSION_CHUNK].astype(np.int64), minlength=found.size)
        found |= counts[: found.size] > 0
    return found[ids].astype(np.int64)


def _update_confusion(
    confusion: ConfusionAccumulator, ids: torch.Tensor, rows: torch.Tensor, target: np.ndarray
) -> None:
    """Add (B, *spatial) predictions (classifier rows) against ``target`` in chunks along the first spatial axis,
    on the device of ``rows`` (only the label chunks travel there, and the K x K counts come back)."""
    ids = ids.to(rows.device)
    per_slice = max(math.prod(rows.shape) // max(rows.shape[1], 1), 1)
    step = max(CONFUSION_CHUNK // per_slice, 1)
    for start in range(0, rows.shape[1], step):
        pred = ids[rows[:, start : start + step]]
        chunk = torch.from_numpy(np.ascontiguousarray(target[:, start : start + step]))
        confusion.update(pred, chunk.to(rows.device).long())


@torch.no_grad()
def evaluate(
    model: Segmenter,
    splits: Sequence[Split],
    seen: Sequence[int],
    device: torch.device,
    mode: str = "sliding-window",
    roi: Sequence[int] | None = None,
    batch_size: int = 4,
    sw_batch_size: int = 4,
    overlap: float = 0.25,
    mc_samples: int = 0,
    seed: int = 0,
    before_split: Callable[[int], None] | None = None,
    max_block_elements: int | None = MAX_BLOCK_ELEMENTS,
    progress: bool = False,
) -> EvalResult:
    """Score ``model`` on the union of ``splits`` over the classes ``seen`` (row order of the classifier).

    Args:
        model: maps (B, C, *spatial) to (B, K, *spatial) logits, K = len(seen).
        splits: test splits: ``len(split)``, ``split.images[i]`` (C, *spatial) and
            ``split.labels[i]`` (*spatial) full ground truth in global ids (255 = ignore);
            samples may differ in shape.
        seen: global class ids of the classifier rows (row 0 = background).
        mode: "sliding-window" or "authors".
        roi: sliding-window ROI / authors' crop size (None = whole sample).
        batch_size: samples per forward when whole samples go through the model.
        sw_batch_size: MONAI sliding-window batch (windows per forward).
        overlap: MONAI sliding-window overlap.
        mc_samples: 0 = deterministic; N > 0 = mean softmax over N GAS noise draws.
        seed: seeds the authors' crop jitter (drawn per sample from (seed, split, sample)).
        before_split: called with the index of each split before it is scored
            (methods with per-domain parts switch to that split's domain).
        max_block_elements: bound on B x K x voxels of one stitched sliding-window
            output (a third of it under MC-GAS, which holds two more such volumes);
            larger samples are scored in blocks with identical results; None = unbounded.
        progress: show a progress bar (samples scored, with ETA).

    With several processes each rank scores its share of every split and the
    counts are summed over ranks, so every rank returns the whole-set scores.
    """
    from tqdm.auto import tqdm

    splits = [_Shard(split) for split in splits]
    bar = tqdm(total=sum(len(split) for split in splits), desc="eval", unit="sample", leave=False, disable=not progress)
    model.eval()
    ids = torch.as_tensor(list(seen), dtype=torch.long)
    confusion = ConfusionAccumulator(list(seen))
    k = len(seen)
    inter = torch.zeros(k, dtype=torch.float64)
    psum = torch.zeros(k, dtype=torch.float64)
    gsum = torch.zeros(k, dtype=torch.float64)
    lut = torch.full((max(256, max(seen) + 1),), -1, dtype=torch.long)
    for row, cid in enumerate(seen):
        lut[cid] = row
    budget = None if max_block_elements is None else max(max_block_elements // (3 if mc_samples > 0 else 1), 1)
    seen_ids = np.asarray(list(seen), dtype=np.int64)
    samples = np.zeros(k, dtype=np.int64)
    for index, split in enumerate(splits):
        if before_split is not None:
            before_split(index)
            model.eval()
        for indices, images, labels in _shape_groups(split, batch_size):
            spatial = images[0].shape[1:]
            crop = mode == "authors" and roi is not None and len(spatial) == 3
            if crop:
                # jitter drawn per sample, so a split shared out over ranks gets the same crops
                crops = [
                    _centred_crop(lab, roi, np.random.default_rng([seed, index, i])) for i, lab in zip(indices, labels)
                ]
                images = [img[(slice(None),) + tuple(c)] for img, c in zip(images, crops)]
                labels = [lab[c] for lab, c in zip(labels, crops)]
                spatial = images[0].shape[1:]
            for lab in labels:
                samples += _presence(lab, seen_ids)
            windowed = mode != "authors" and roi is not None and any(r < s for r, s in zip(roi, spatial))
            if windowed:
                # one sample at a time: MONAI batches windows, not samples, so nothing is lost
                for image, label in zip(images, labels):
                    x = torch.from_numpy(np.ascontiguousarray(image[None])).float().to(device)
                    for block in plan_blocks(spatial, roi, overlap, k, budget):
                        scores = _block_scores(
                            model,
                            x[(slice(None), slice(None)) + tuple(block.source)],
                            roi,
                            sw_batch_size,
                            overlap,
                            mc_samples,
                        )
                        rows = class_rows(scores[(slice(None), slice(None)) + tuple(block.local)])
                        del scores
                        _update_confusion(confusion, ids, rows, label[None][(slice(None),) + tuple(block.target)])
                    bar.update(1)
                continue
            x = torch.from_numpy(_stack(images)).float().to(device)
            # everything on the device; the argmax of the logits is that of the softmax, which only the authors'
            # soft Dice and the mean over GAS draws need
            if mode == "authors" or mc_samples > 0:
                scores = _probabilities(model, x, mc_samples)
            else:
                scores = torch.as_tensor(model(x))
            if mode == "authors":
                y = torch.from_numpy(_stack(labels)).to(device).long()
                table = lut.to(device)
                rows = table[y.clamp(0, len(lut) - 1)].masked_fill(y >= len(lut), -1)
                valid = (rows >= 0).unsqueeze(1)
                onehot = torch.zeros_like(scores).scatter_(1, rows.clamp(min=0).unsqueeze(1), 1.0) * valid
                p = scores * valid
                dims = [0, *range(2, p.dim())]
                inter += (p * onehot).sum(dims).double().cpu()
                psum += p.sum(dims).double().cpu()
                gsum += onehot.sum(dims).double().cpu()
            _update_confusion(confusion, ids, class_rows(scores), _stack(labels))
            bar.update(len(labels))
    bar.close()
    confusion.all_reduce()
    inter, psum, gsum = (distributed.all_reduce_sum(v) for v in (inter, psum, gsum))
    present = distributed.all_reduce_sum(torch.from_numpy(samples))
    cm = confusion.matrix()
    support = cm.sum(1)  # rows: ground truth
    iou = iou_from_confusion(cm)
    if mode == "authors":
        smooth = 1e-5
        dice_t = (2 * inter + smooth) / (psum + gsum + smooth)
        dice_t[gsum == 0] = math.nan
    else:
        dice_t = dice_from_confusion(cm)
    return EvalResult(
        dice={c: float(dice_t[i]) for i, c in enumerate(seen)},
        iou={c: float(iou[i]) for i, c in enumerate(seen)},
        support={c: int(support[i]) for i, c in enumerate(seen)},
        samples={c: int(present[i]) for i, c in enumerate(seen)},
    )
