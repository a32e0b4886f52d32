"""GAPS: guided copy-and-paste synthesis for few-shot incremental segmentation.

Qiu, Chen, Sun, Wang, Hauser, "GAPS: Few-Shot Incremental Semantic
Segmentation via Guided Copy-Paste Synthesis", CVPR Workshops (L3D-IVU) 2023
(official code github.com/RogerQi/GAPS, ``fs_incremental_trainer.py`` and
``utils/non_parametric.py``; defaults from ``configs/fs_incremental/pascal5i_base.yaml``).

What it does:

* *Diverse memory replay buffer* (``baseset_type: uniform_interval``): at the
  end of the base session every base training image containing a base class c
  is scored by cos(masked average of its normalised features on c, classifier
  row of c) / (fraction of the image that is c); per class, the images are
  sorted by score and m = 2 * (memory_size // #base classes) of them are drawn,
  one uniformly from each of m equal intervals of the sorted list; the union is
  subsampled to ``memory_size`` (500) images, kept with their base labels.
* *Partial data pool*: every labelled image of an incremental session gives,
  for each class c it shows, the crop of the image and of the mask of c to the
  bounding box of c. The pool is kept for all later sessions.
* *Guided synthesis*: every training sample of an incremental session is
  synthesised (the session's own images are used only as paste sources):
  pick a class c of the session; pick a memory image -- with probability 0.9
  among the memory images whose scene embedding (global average of the
  features, L2-normalised) is among the top 5 % most similar to one of c's
  support images (context-aware sampling), otherwise uniformly; with
  probability p paste two objects of other pool classes, then with
  probability p two objects of c, where (``vRFS``) p = 2r / (3r + 1),
  r = max(1, sqrt((1/K) / (shots / memory size))), K = base + pool classes.
  Each paste flips horizontally with probability 1/2, rescales by U(0.1, 2)
  (shrunk to fit) and translates uniformly; pasted pixels take the object's
  intensities and class.
* *Training*: the loop's segmentation loss on the synthesised, fully labelled
  images, plus ``0.1 * MSE(features, features of the model at the start of the
  session)`` (feature regularisation); the backbone is fine-tuned at 1/10 of
  the classifier's learning rate (official 1e-3 vs 1e-2) with BatchNorm frozen.
* New classifier rows: the loop's prototype imprinting (GAPS imprints with
  masked-average-pooled prototypes too).

Deviations:

* The stored base images (the memory) are part of GAPS; they are kept as
  plugin state, which makes GAPS an exemplar-replay method, unlike most others here.
* The scene embedding is the global average of the features before the
  classifier (GAPS: the pooled last encoder stage of its ResNet).
* "Horizontal" flip = flip of the last spatial axis, in 2D and 3D; the
  official random scale-crop of memory images is replaced by the loop's
  patch cropping and flips (``augment``).
* #base classes in vRFS counts the background (the official count follows its
  dataset's label range); the optimiser, schedule, iterations and batch size
  are the run configuration's (official: SGD momentum 0.9, poly, 200 iterations of 10).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from jascl.engine.plugin import Method, Plugin
from jascl.methods.baselines.fewshot._gaps_features import memory_scores, scene_embeddings
from jascl.methods.common import frozen_copy, labelled_loader, patch_around
from jascl.methods.options import check_options, freeze_option, freeze_policy, option
from jascl.methods.registry import METHODS
from jascl.networks.base import resize

if TYPE_CHECKING:
    from jascl.engine.config import RunConfig
    from jascl.engine.state import LoopState


# ---------------------------------------------------------------------------- pure functions


def crop_to_object(image: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Crop an image and a binary mask to the mask's bounding box (official ``crop_partial_img``).

    Args:
        image: (C, *spatial).
        mask: (*spatial) bool, with at least one True.

    Returns:
        (C, *box) image crop and (*box) bool mask crop.
    """
    idx = mask.nonzero()
    if idx.numel() == 0:
        raise ValueError("cannot crop to an empty mask")
    box = tuple(slice(int(lo), int(hi) + 1) for lo, hi in zip(idx.min(0).values, idx.max(0).values))
    return image[(slice(None),) + tuple(box)], mask[box]


@dataclass(frozen=True)
class PasteParams:
    """Where and how one object is pasted: flip of the last axis, pasted size and offset per spatial axis."""

    flip: bool
    size: tuple[int, ...]
    offset: tuple[int, ...]


def sample_paste(
    rng: np.random.Generator,
    object_shape: Sequence[int],
    base_shape: Sequence[int],
    scale_range: tuple[float, float] = (0.1, 2.0),
) -> PasteParams:
    """Random flip, scale and translation of the official ``copy_and_paste``.

    The scale U(scale_range) is shrunk, axis by axis, until the object fits the
    base image; the offset is uniform in [0, base - size) along every axis when
    the object is smaller than the image along every axis, else 0.
    """
    flip = bool(rng.random() < 0.5)
    scale = float(rng.uniform(*scale_range))
    for src, dst in zip(object_shape, base_shape):
        if src * scale > dst:
            scale = dst / src
    size = tuple(max(1, int(src * scale)) for src in object_shape)
    if all(b > s for b, s in zip(base_shape, size)):
        offset = tuple(int(rng.integers(0, b - s)) for b, s in zip(base_shape, size))
    else:
        offset = (0,) * len(size)
    return PasteParams(flip, size, offset)


def paste_object(
    base_image: torch.Tensor,
    base_label: torch.Tensor,
    object_image: torch.Tensor,
    object_mask: torch.Tensor,
    class_id: int,
    params: PasteParams,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Paste an object crop into a copy of a base image and label.

    Args:
        base_image: (C, *spatial) image; base_label: (*spatial) label.
        object_image: (C, *box) crop; object_mask: (*box) bool, the object's pixels.
        class_id: label value written on the pasted pixels.
        params: flip / size / offset (see :func:`sample_paste`).

    Returns:
        New (image, label): inside ``offset + [0, size)``, the pixels of the
        (flipped, resized) mask take the object's intensities and ``class_id``.
    """
    image, label = base_image.clone(), base_label.clone()
    obj, mask = object_image.float(), object_mask
    if params.flip:
        obj, mask = obj.flip(-1), mask.flip(-1)
    if tuple(mask.shape) != params.size:
        obj = resize(obj[None], params.size)[0]
        mask = resize(mask[None, None].float(), params.size, mode="nearest")[0, 0] > 0.5
    region = tuple(slice(o, o + s) for o, s in zip(params.offset, params.size))
    image_region = image[(slice(None),) + tuple(region)]
    image_region[:, mask] = obj[:, mask].to(image.dtype)
    label[region][mask] = class_id
    return image, label


def vrfs_probabilities(total_classes: int, shots: int, memory_size: int) -> float:
    """The official ``vRFS`` paste probability (same for other-class and selected-class pastes).

    r = max(1, sqrt((1/K) / (shots / memory_size))); p = (r + r) / (r + r + 1 + r).
    """
    r = max(1.0, math.sqrt((1.0 / total_classes) / (shots / memory_size)))
    return 2 * r / (3 * r + 1)


def uniform_interval_pick(n_sorted: int, count: int, rng: np.random.Generator) -> list[int]:
    """Positions drawn one per interval from ``count`` equal intervals of a sorted list of length n.

    Official ``uniform_interval``: local = min(count, n), width = n // local,
    one uniform position in [width * i, min(width * (i + 1), n)) for each i < local.
    """
    local = min(count, n_sorted)
    if local <= 0:
        return []
    width = n_sorted // local
    return [int(rng.integers(width * i, min(width * (i + 1), n_sorted))) for i in range(local)]


def context_candidates(support: torch.Tensor, memory: torch.Tensor, fraction: float = 0.05) -> list[int]:
    """Memory indices among the top ``fraction`` most cosine-similar to any support embedding.

    Args:
        support: (S, D) normalised scene embeddings of a class's support images.
        memory: (M, D) normalised scene embeddings of the memory images.

    Returns:
        Sorted union of the top max(1, int(fraction * M)) indices per support image.
    """
    k = max(1, int(fraction * memory.shape[0]))
    sim = support @ memory.t()  # (S, M)
    top = sim.topk(k, dim=1).indices
    return sorted(set(top.flatten().tolist()))


# ---------------------------------------------------------------------------- plugin


@dataclass
class GAPSOptions:
    """``method_args.gaps`` options (defaults: official GAPS configuration for Pascal-5i).

    Attributes:
        memory_size: base images kept (official ``memory_bank_size`` = 500).
        context_prob: probability of context-aware memory sampling (official 0.9).
        context_fraction: fraction of the memory that is "similar" per support image (official 0.05).
        pastes: objects pasted per paste event (official 2 for vRFS).
        feature_weight: weight of the feature regularisation (official ``feature_reg_lambda`` = 0.1).
        backbone_lr_scale: backbone learning rate / classifier learning rate (official 1e-3 / 1e-2).
        freeze_bn: keep BatchNorm layers frozen while fine-tuning (official).
        freeze: "none" (official: the backbone is fine-tuned), "all_but_classifier" or "config".
    """

    memory_size: int = option(500, ge=1)
    context_prob: float = option(0.9, ge=0, le=1)
    context_fraction: float = option(0.05, ge=0, le=1)
    pastes: int = option(2, ge=0)
    feature_weight: float = option(0.1, ge=0)
    backbone_lr_scale: float = option(0.1, ge=0)
    freeze_bn: bool = True
    freeze: str = freeze_option("none")


@dataclass
class PoolEntry:
    """A support image of a class and its crop to the class's bounding box."""

    class_id: int
    image: torch.Tensor  # (C, *spatial)
    mask: torch.Tensor  # (*spatial) bool
    crop_image: torch.Tensor
    crop_mask: torch.Tensor

    @classmethod
    def make(cls, class_id: int, image: torch.Tensor, mask: torch.Tensor) -> PoolEntry:
        ci, cm = crop_to_object(image, mask)
        return cls(class_id, image, mask, ci, cm)


class GAPSPlugin(Plugin):
    """Guided copy-paste synthesis of every incremental training batch (see module docstring)."""

    name = "gaps"
    loss_terms = ("gaps_feat",)

    def __init__(self, options: GAPSOptions | None = None) -> None:
        o = self.options = options or GAPSOptions()
        check_options(o, "method_args.gaps")
        self.freeze_incremental = freeze_policy(o.freeze)
        self.memory_images: list[torch.Tensor] = []
        self.memory_labels: list[torch.Tensor] = []
        self.pool: list[PoolEntry] = []
        self.num_base_classes = 0
        self.teacher = None
        self._context: dict[int, list[int]] = {}
        self._rng: np.random.Generator | None = None
        self._active = False

    # ------------------------------------------------------------- memory (base session)

    @torch.no_grad()
    def build_memory(self, state: LoopState) -> None:
        """Select the diverse memory from the base session's labelled data with the base model."""
        o = self.options
        rng = np.random.default_rng([state.seed, 104729])
        classes = list(state.session.classes)
        self.num_base_classes = len(state.seen)
        scores = memory_scores(state, classes)
        per_class = 2 * max(1, o.memory_size // max(1, len(classes)))
        chosen: set[int] = set()
        for c in classes:
            ranked = [i for _, i in sorted(scores[c], key=lambda s: s[0])]
            chosen.update(ranked[p] for p in uniform_interval_pick(len(ranked), per_class, rng))
        chosen_list = sorted(chosen)
        keep = rng.choice(chosen_list, size=min(o.memory_size, len(chosen_list)), replace=False) if chosen_list else []
        # a second pass keeps the chosen images alone, cut to the patch around a taught pixel (in index order)
        kept, patch = {int(k) for k in keep}, state.config.patch_size
        samples = (s for batch in labelled_loader(state) for s in zip(batch["image"], batch["label"]))
        patches = [[t.clone() for t in patch_around(*s, patch, rng)] for i, s in enumerate(samples) if i in kept]
        self.memory_images = [image for image, _ in patches]
        self.memory_labels = [label for _, label in patches]

    def after_training(self, state: LoopState) -> None:
        if state.session.index == 0:
            self.build_memory(state)

    def session_restored(self, state: LoopState) -> None:
        if state.session.index == 0 and not self.memory_images:
            self.build_memory(state)

    # ------------------------------------------------------------- incremental sessions

    def before_session(self, state: LoopState) -> None:
        self._active = False
        self.teacher = None
        t = state.session.index
        if t == 0:
            return
        if not self.memory_images:
            raise RuntimeError("GAPS has no memory of base images; session 0 must be trained or restored first")
        o = self.options
        self._rng = np.random.default_rng([state.seed, t, 7127])
        support: dict[int, list[torch.Tensor]] = {}
        for batch in labelled_loader(state):
            for image, label in zip(batch["image"], batch["label"]):
                for c in state.session.classes:
                    mask = label == c
                    if mask.any():
                        self.pool.append(PoolEntry.make(c, image.clone(), mask))
                        support.setdefault(c, []).append(image)
        self._classes = [c for c in state.session.classes if c in support]
        if not self._classes:
            raise RuntimeError(f"GAPS: session {t} has no labelled pixels of its classes")
        memory_emb = scene_embeddings(state, state.model, self.memory_images)
        self._context = {}
        for c, images in support.items():
            emb = scene_embeddings(state, state.model, images)
            self._context[c] = context_candidates(emb, memory_emb, o.context_fraction)
        if o.freeze_bn:
            for m in state.model.modules():
                if isinstance(m, nn.modules.batchnorm._BatchNorm):
                    for p in m.parameters():
                        p.requires_grad_(False)  # before the loop collects the trainable parameters
        self.teacher = frozen_copy(state, keep_random_stream=False)
        self._active = True

    def make_optimizer(self, state: LoopState, params: list, lr: float) -> torch.optim.Optimizer | None:
        if state.session.index == 0:
            return None
        cfg = state.config
        head = {id(p) for p in state.model.classifier.parameters()}
        groups = [
            {"params": [p for p in params if id(p) in head], "lr": lr},
            {"params": [p for p in params if id(p) not in head], "lr": lr * self.options.backbone_lr_scale},
        ]
        return torch.optim.SGD(
            [g for g in groups if g["params"]],
            lr=lr,
            momentum=cfg.momentum,
            weight_decay=cfg.weight_decay,
            nesterov=cfg.nesterov and cfg.momentum > 0,
        )

    #: before_epoch only puts BatchNorm layers back in eval mode: redone by resume_epoch
    mid_epoch_resume = True

    def resume_epoch(self, state: LoopState) -> None:
        self.before_epoch(state)

    def before_epoch(self, state: LoopState) -> None:
        if self._active and self.options.freeze_bn:
            for m in state.model.modules():
                if isinstance(m, nn.modules.batchnorm._BatchNorm):
                    m.eval()

    def synthesise(
        self, novel: int, shape: Sequence[int] | None = None, augment: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One synthesised (image (C, *spatial), label (*spatial)) sample for session class ``novel``."""
        o, rng = self.options, self._rng
        context = self._context.get(novel) or []
        if context and rng.random() < o.context_prob:
            base = context[int(rng.integers(len(context)))]
        else:
            base = int(rng.integers(len(self.memory_images)))
        image, label = self.memory_images[base], self.memory_labels[base]
        by_class: dict[int, list[PoolEntry]] = {}
        for entry in self.pool:
            by_class.setdefault(entry.class_id, []).append(entry)
        others = [c for c in by_class if c != novel]
        p = vrfs_probabilities(self.num_base_classes + len(by_class), len(by_class[novel]), len(self.memory_images))

        def paste(img, lab, entry):
            params = sample_paste(rng, entry.crop_mask.shape, lab.shape)
            return paste_object(img, lab, entry.crop_image, entry.crop_mask, entry.class_id, params)

        if len(by_class) > 1 and rng.random() < p:
            for _ in range(o.pastes):
                cls = others[int(rng.integers(len(others)))]
                image, label = paste(image, label, by_class[cls][int(rng.integers(len(by_class[cls])))])
        if rng.random() < p:
            for _ in range(o.pastes):
                image, label = paste(image, label, by_class[novel][int(rng.integers(len(by_class[novel])))])
        if augment:
            for axis in range(label.dim()):
                if rng.random() < 0.5:
                    image, label = image.flip(axis + 1), label.flip(axis)
        if shape is not None and tuple(shape) != tuple(label.shape) and all(s <= L for s, L in zip(shape, label.shape)):
            start = [int(rng.integers(0, L - s + 1)) for s, L in zip(shape, label.shape)]
            box = tuple(slice(a, a + s) for a, s in zip(start, shape))
            image, label = image[(slice(None),) + tuple(box)], label[box]
        return image.contiguous(), label.contiguous()

    def before_iteration(self, state: LoopState) -> None:
        if not self._active:
            return
        size = len(state.batch["image"])
        shape = state.batch["image"].shape[2:]
        samples = [
            self.synthesise(self._classes[int(self._rng.integers(len(self._classes)))], shape, state.config.augment)
            for _ in range(size)
        ]
        state.batch = {
            "image": torch.stack([s[0] for s in samples]).float(),
            "label": torch.stack([s[1] for s in samples]).long(),
            "id": ["gaps-synthetic"] * size,
        }

    def after_forward(self, state: LoopState) -> None:
        if not self._active or self.options.feature_weight == 0:
            return
        with torch.no_grad():
            old = self.teacher.backbone(state.batch["image"].to(state.device))
        state.losses["gaps_feat"] = self.options.feature_weight * F.mse_loss(state.output.features, old)

    def after_session(self, state: LoopState) -> None:
        self._active = False
        self.teacher = None

    # ------------------------------------------------------------- state

    def extra_state(self) -> dict[str, torch.Tensor]:
        out = {"num_base_classes": torch.tensor([self.num_base_classes])}
        for i, (image, label) in enumerate(zip(self.memory_images, self.memory_labels)):
            out[f"memory.{i}.image"], out[f"memory.{i}.label"] = image, label
        for j, entry in enumerate(self.pool):
            out[f"pool.{j}.image"], out[f"pool.{j}.mask"] = entry.image, entry.mask.to(torch.uint8)
            out[f"pool.{j}.class"] = torch.tensor([entry.class_id])
        return out

    def load_extra_state(self, tensors: dict[str, torch.Tensor]) -> None:
        self.num_base_classes = int(tensors["num_base_classes"][0])
        n_mem = len([k for k in tensors if k.startswith("memory.") and k.endswith(".image")])
        n_pool = len([k for k in tensors if k.startswith("pool.") and k.endswith(".image")])
        self.memory_images = [tensors[f"memory.{i}.image"] for i in range(n_mem)]
        self.memory_labels = [tensors[f"memory.{i}.label"].long() for i in range(n_mem)]
        self.pool = [
            PoolEntry.make(
                int(tensors[f"pool.{j}.class"][0]), tensors[f"pool.{j}.image"], tensors[f"pool.{j}.mask"].bool()
            )
            for j in range(n_pool)
        ]


@METHODS.register(
    "gaps",
    options=GAPSOptions,
    paper="Qiu et al., CVPR Workshops 2023",
    doc="baseline: guided copy-paste synthesis with a base-image memory",
    fidelity="faithful",
    flags=("uses exemplars",),
)
def gaps(options: GAPSOptions, config: RunConfig) -> Method:
    return Method("gaps", [GAPSPlugin(options)], "GAPS: guided copy-paste synthesis from a diverse base-image memory")
