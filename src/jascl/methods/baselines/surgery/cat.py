"""CAT: overlapping class-aware temperature normalisation, with multi-scale shifted-feature distillation (M. Xu,
M. Islam, L. Bai, H. Ren, "Privacy-Preserving Synthetic Continual Semantic Segmentation for Robotic Surgery",
IEEE TMI 43(6), 2024; code github.com/XuMengyaAmy/Synthetic_CAT_SD).

The method's continual part is ILT (output + feature distillation from the previous model) with two changes:

* CAT (class-aware temperature): the output distillation divides both models' logits at pixel p by a
  temperature T_p that depends on the pixel's class: T_unique for the *unique old* classes (old classes the
  new session does not annotate -- in the paper, the EndoVis 2017 instruments absent from EndoVis 2018) and
  T_rest for every other pixel (background, the overlapping classes annotated in both, new classes)::

      L_kd = 1/|P| sum_p  -(1/K_old) sum_{c < K_old} softmax(z_old(p) / T_p)_c  log softmax(z_new(p)[:K_old] / T_p)_c

  (the class mean of MiB's re-implementation of LwF/ILT that the authors' code builds on; no T^2 factor).
* SD (multi-scale shifted-feature distillation): besides ILT's mean squared error between the encoder features
  f and f_old, the MSE between their pooled embeddings E(f): width- and height-pooled strips of a spatial
  pyramid (scales 2, 4, 8: :func:`jascl.methods.baselines.distillation.plop.local_pod`) and of a *shifted* 3 x 3
  grid whose cuts are at n/4 and n - n/4 on every axis, so that the regions straddle the pyramid's cuts and
  carry longer-range relations (:func:`shifted_pod`)::

      L_sd = MSE(f, f_old) + MSE(E(f), E(f_old))

The loss is ``seg + kd_weight * L_kd + sd_weight * L_sd`` (the authors' loss_kd = 100, loss_de = 50,
temperatures 4 for the unique old classes and 3 for the rest, their EndoVis 17 -> 18 script).

The synthetic data (the "Synthetic" of CAT-SD; :mod:`._blend` gives the recipe and its source): the authors train
the new session on blended images only -- new instruments on augmented real backgrounds, and a memory of 500 images
of the *old* instruments (open-source foregrounds, not patient data) blended onto synthesised backgrounds. Here,
in every incremental session, a share ``synthetic`` (1.0: all, as the authors) of every training batch is replaced
by blended samples (``before_iteration``): the batch image, augmented, is the background (its labels kept), and one
instrument (p 0.8) or two of different classes are pasted on it -- with probability ``old_share`` cut-outs of old
classes from the memory, else cut-outs of the session's own labelled images (its taught classes). The memory keeps
``memory`` cut-outs per class of every earlier session (cut from its training crops at its end, chosen at random),
so CAT **stores foreground cut-outs of earlier sessions** (the authors' old instruments; no background, but real
pixels of earlier images: an exemplar memory of a kind, flagged in the method's fidelity label). The pasted pixels
carry their class, so the old-instrument pixels are annotated as in the authors' data and the class-aware
temperature finds them from the labels (``partition="label"``, the authors' code, is the default).

Deviations, for our loop and the paper's benchmarks:
    * Synthetic data (see :mod:`._blend`): no harmonisation network after blending; old cut-outs are pasted on the
      session's own (augmented) images instead of StyleGAN-XL backgrounds trained on the old data; the old
      foregrounds are cut from earlier sessions' labelled images (the authors used open-source instrument images);
      ``memory`` (3 per class, the MICCAI 2022 synthesis used 2-3 source images per instrument) and ``old_share``
      (0.5) are our choices; blended samples are made on the fly, a fresh augmentation every iteration, instead of
      a fixed set written to disk.
    * Which pixels are "unique old": labels first (pasted old instruments are labelled). An old class not taught
      in the session that appears in a real background is hidden (labelled background or ignore);
      ``partition="label_or_teacher"`` also gives such a pixel the previous model's prediction as its class.
    * Unique-old classes are those of the previous classifier (background excluded) that the session does not
      teach; the authors list them by hand (classes 4 and 5 of their label map).
    * Feature distillation on the backbone's "encoder" alias (e.g. the U-Net bottleneck) captured by a forward
      hook, for the authors' DeepLab-v3 ResNet body output; the pyramid and shifted grid are generalised to 3D
      and to maps whose sides are not multiples of the scales (remainders dropped, empty regions skipped).
      The authors' scripts use several scale sets (2-4, 2-4-8, 1-2-4-8); 2-4-8 is the default here.
    * The new classifier rows start as the loop's default (prototype imprinting), not the authors' random rows.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from jascl.data.sampling import derive_seed
from jascl.engine.plugin import Method
from jascl.errors import ConfigError
from jascl.methods.baselines.distillation._shared import FeatureTap, TeacherPlugin
from jascl.methods.baselines.distillation.plop import local_pod
from jascl.methods.baselines.surgery._blend import Cutout, blend_sample, cut_instruments
from jascl.methods.common import labelled_crops
from jascl.methods.options import freeze_option, freeze_policy, option
from jascl.methods.registry import METHODS
from jascl.protocols.schema import IGNORE_INDEX

if TYPE_CHECKING:
    from jascl.engine.config import RunConfig
    from jascl.engine.state import LoopState


def pixel_classes(target: torch.Tensor, teacher_logits: torch.Tensor | None = None) -> torch.Tensor:
    """The class (classifier row) of each pixel for CAT's partition.

    Args:
        target: (B, *spatial) rows, 255 = ignore.
        teacher_logits: (B, K_old, *spatial) of the previous model, or None.

    Returns:
        (B, *spatial): the label; where it is background (0) or ignored and ``teacher_logits`` is given, the
        previous model's prediction (old classes hidden in the session's labels); else the label itself.
    """
    if teacher_logits is None:
        return target
    hidden = (target == 0) | (target == IGNORE_INDEX)
    return torch.where(hidden, teacher_logits.argmax(dim=1), target)


def cat_temperature_map(
    classes: torch.Tensor, unique_old: Sequence[int], t_unique: float, t_rest: float
) -> torch.Tensor:
    """Per-pixel temperature: ``t_unique`` where the pixel's class is a unique old class, ``t_rest`` elsewhere.

    Args:
        classes: (B, *spatial) rows (see :func:`pixel_classes`).
        unique_old: rows of the old classes the session does not annotate.

    Returns:
        (B, 1, *spatial) float temperatures (broadcast over the class dim).
    """
    rows = torch.as_tensor(list(unique_old), dtype=classes.dtype, device=classes.device)
    temps = torch.full(classes.shape, t_rest, dtype=torch.float32, device=classes.device)
    return temps.masked_fill_(torch.isin(classes, rows), t_unique).unsqueeze(1)


def cat_kd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """CAT's output distillation: per pixel ``-(1/K_old) sum_c q_c log p_c`` with ``q = softmax(z_old / T_p)`` and
    ``p = softmax(z_new[:, :K_old] / T_p)``, averaged over pixels.

    Args:
        student_logits: (B, K, *spatial), K >= K_old.
        teacher_logits: (B, K_old, *spatial).
        temperature: (B, 1, *spatial) per-pixel temperatures (or a broadcastable tensor).
    """
    k_old = teacher_logits.shape[1]
    temperature = temperature.to(student_logits.dtype)
    log_p = F.log_softmax(student_logits[:, :k_old] / temperature, dim=1)
    q = F.softmax(teacher_logits / temperature, dim=1)
    return (-(q * log_p).sum(dim=1) / k_old).mean()


def _cuts(n: int) -> list[tuple[int, int]]:
    """The shifted grid's intervals on an axis of length n: cuts at n // 4 and n - n // 4 (empty ones dropped)."""
    edges = [0, n // 4, n - n // 4, n]
    return [(a, b) for a, b in zip(edges[:-1], edges[1:]) if b > a]


def shifted_pod(x: torch.Tensor) -> torch.Tensor:
    """Strip-pooled embedding of the shifted 3 x 3 (x 3) grid of SD (cuts at n/4 and n - n/4 on every axis).

    For every region and every spatial axis, the features averaged over the other spatial axes (2D: the
    region's width- and height-pooled strips, as POD), flattened and concatenated.

    Args:
        x: (B, C, *spatial).

    Returns:
        (B, E).
    """
    b = x.shape[0]
    axes = list(range(2, x.dim()))
    parts = []
    for region in itertools.product(*[_cuts(n) for n in x.shape[2:]]):
        tensor = x[(slice(None), slice(None)) + tuple(slice(lo, hi) for lo, hi in region)]
        for axis in axes:
            parts.append(tensor.mean(dim=[a for a in axes if a != axis]).reshape(b, -1))
    return torch.cat(parts, dim=1)


def sd_loss(student: torch.Tensor, teacher: torch.Tensor, scales: Sequence[int] = (2, 4, 8)) -> torch.Tensor:
    """SD: ``MSE(f, f_old) + MSE(E(f), E(f_old))`` with E = [pyramid strips at ``scales``, shifted-grid strips]."""
    embed = [local_pod(student, scales), shifted_pod(student)]
    embed_t = [local_pod(teacher, scales), shifted_pod(teacher)]
    return F.mse_loss(student, teacher) + F.mse_loss(torch.cat(embed, dim=1), torch.cat(embed_t, dim=1))


def unique_old_rows(state: LoopState) -> list[int]:
    """Rows of the previous classifier's classes (background excluded) that this session does not annotate."""
    taught = set(state.session.classes)
    return [row for row, cid in enumerate(state.previous_seen) if row > 0 and cid not in taught]


@dataclass
class CATOptions:
    """Options of ``cat`` (defaults: the authors' EndoVis 17 -> 18 script: loss_kd 100, loss_de 50,
    temperature 4 on the unique old classes, 3 elsewhere).

    Attributes:
        kd_weight: weight of the class-aware-temperature output distillation.
        sd_weight: weight of the shifted-feature distillation (0: CAT alone).
        temperature_unique: T of pixels of old classes the session does not annotate.
        temperature_rest: T of every other pixel.
        scales: parts per axis of the feature pyramid of SD.
        feature_layer: layer whose output SD distils ("encoder", "decoder" or a module path).
        partition: "label" (the labels only, as the authors' code; pasted old instruments are labelled) or
            "label_or_teacher" (background or ignored pixels take the previous model's class).
        synthetic: share of every incremental training batch replaced by blended samples (the authors: 1.0);
            0 turns the synthetic data off (CAT + SD on the real batches alone).
        old_share: probability that a blended sample pastes old instruments (from the memory) instead of the
            session's own.
        memory: cut-outs kept per class of every earlier session (0: none, no old instruments are pasted).
        freeze: incremental-session freezing; "none" (the authors fine-tune the network).
    """

    kd_weight: float = option(100.0, ge=0)
    sd_weight: float = option(50.0, ge=0)
    temperature_unique: float = option(4.0, gt=0)
    temperature_rest: float = option(3.0, gt=0)
    scales: list = option([2, 4, 8])
    feature_layer: str = "encoder"
    partition: str = option("label", choices=("label_or_teacher", "label"))
    synthetic: float = option(1.0, ge=0, le=1)
    old_share: float = option(0.5, ge=0, le=1)
    memory: int = option(3, ge=0)
    freeze: str = freeze_option("none")


class CATPlugin(TeacherPlugin):
    """CAT-SD's continual part: class-aware-temperature logit distillation (``cat_kd``) and multi-scale shifted
    feature distillation (``cat_sd``) from the previous session's frozen model (see the module docstring)."""

    name = "cat"
    loss_terms = ("cat_kd", "cat_sd")
    #: the memory changes only between sessions (saved with each session's checkpoint)
    snapshot_exclude = ("memory", "harvested")

    def __init__(self, options: CATOptions | None = None, freeze: str | None = "none") -> None:
        super().__init__(freeze)
        self.o = options or CATOptions()
        self.loss_terms = ("cat_kd", "cat_sd") if self.o.sd_weight > 0 else ("cat_kd",)
        self._taps: tuple[FeatureTap, FeatureTap] | None = None
        self._unique: list[int] = []
        self.memory: list[Cutout] = []  # cut-outs of earlier sessions' classes (the old instruments)
        self.harvested: list[int] = []  # sessions whose cut-outs were offered to the memory
        self._current: list[Cutout] = []  # the session's own cut-outs
        self._rng: np.random.Generator | None = None
        self.blended = 0  # blended samples made this session

    # ------------------------------------------------------------------ synthetic data

    def _session_cutouts(self, state: LoopState) -> list[Cutout]:
        """Cut-outs of the session's taught classes from its training crops (no augmentation)."""
        dataset = labelled_crops(state, "cat-cutouts")
        out: list[Cutout] = []
        for i in range(len(dataset)):
            item = dataset[i]
            out += cut_instruments(item["image"], item["label"], state.session.classes)
        return out

    def harvest(self, state: LoopState) -> None:
        """Keep ``memory`` cut-outs per class of the session that ends (chosen at random, seeded)."""
        t = state.session.index
        if t in self.harvested:
            return
        self.harvested.append(t)
        if self.o.memory == 0 or len(state.data.train) == 0:
            return
        rng = np.random.default_rng(derive_seed(state.seed, "cat-memory", t))
        cutouts = self._session_cutouts(state)
        for c in sorted({cut.class_id for cut in cutouts}):
            of_class = [cut for cut in cutouts if cut.class_id == c]
            for j in sorted(rng.permutation(len(of_class))[: self.o.memory].tolist()):
                self.memory.append(of_class[j])

    def before_iteration(self, state: LoopState) -> None:
        if self.teacher is None or self._rng is None or self.o.synthetic == 0:
            return
        rng, batch = self._rng, state.batch
        images, labels = batch["image"].clone(), batch["label"].clone()
        for i in range(len(images)):
            if rng.random() >= self.o.synthetic:
                continue
            use_old = bool(self.memory) and (not self._current or rng.random() < self.o.old_share)
            source = self.memory if use_old else self._current
            if not source:
                continue
            images[i], labels[i] = blend_sample(images[i], labels[i], source, rng)
            self.blended += 1
        state.batch = {
            **batch,
            "image": images,
            "label": labels,
            "ignore": (labels == IGNORE_INDEX).flatten(1).any(dim=1),
        }

    def session_restored(self, state: LoopState) -> None:
        self.harvest(state)

    def extra_state(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {"harvested": torch.tensor(self.harvested, dtype=torch.long)}
        for i, cut in enumerate(self.memory):
            out[f"memory.{i}.image"] = cut.image.float().contiguous()
            out[f"memory.{i}.mask"] = cut.mask.to(torch.uint8).contiguous()
            out[f"memory.{i}.class"] = torch.tensor([cut.class_id])
        return out

    def load_extra_state(self, tensors: dict[str, torch.Tensor]) -> None:
        self.harvested = [int(t) for t in tensors["harvested"].tolist()] if "harvested" in tensors else []
        count = len([k for k in tensors if k.startswith("memory.") and k.endswith(".image")])
        self.memory = [
            Cutout(
                int(tensors[f"memory.{i}.class"][0]), tensors[f"memory.{i}.image"], tensors[f"memory.{i}.mask"].bool()
            )
            for i in range(count)
        ]

    # ------------------------------------------------------------------ events

    def before_session(self, state: LoopState) -> None:
        super().before_session(state)
        self._rng, self._current, self.blended = None, [], 0
        if self.teacher is None:
            return
        if self.o.synthetic > 0:
            self._current = self._session_cutouts(state)
            self._rng = np.random.default_rng(derive_seed(state.seed, "cat-synthetic", state.session.index))
        self._unique = unique_old_rows(state)
        if self.o.sd_weight > 0:
            layer = self.o.feature_layer
            self._taps = (FeatureTap(state.model, [layer]), FeatureTap(self.teacher, [layer]))

    def temperatures(self, target: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
        """(B, 1, *spatial) per-pixel temperatures of the batch."""
        classes = pixel_classes(target, teacher_logits if self.o.partition == "label_or_teacher" else None)
        return cat_temperature_map(classes, self._unique, self.o.temperature_unique, self.o.temperature_rest)

    def after_forward(self, state: LoopState) -> None:
        if self.teacher is None:
            return
        out_t = self.teacher_outputs(state)
        teacher_logits = out_t.logits[:, : self.num_old]
        target = state.target
        if target.shape[1:] != teacher_logits.shape[2:]:
            raise ConfigError("method cat: the logits and the labels have different spatial sizes")
        temps = self.temperatures(target, teacher_logits)
        state.losses["cat_kd"] = self.o.kd_weight * cat_kd_loss(state.output.logits, teacher_logits, temps)
        if self._taps is not None:
            name = self.o.feature_layer
            state.losses["cat_sd"] = self.o.sd_weight * sd_loss(self._taps[0][name], self._taps[1][name], self.o.scales)

    def after_training(self, state: LoopState) -> None:
        if self._taps is not None:
            for tap in self._taps:
                tap.remove()
            self._taps = None
        if self.teacher is not None and self._rng is not None:
            state.report["cat_synthetic"] = {
                "blended": self.blended,
                "session_cutouts": len(self._current),
                "memory_cutouts": len(self.memory),
            }

    def after_session(self, state: LoopState) -> None:
        super().after_session(state)
        self._current, self._rng = [], None
        self.harvest(state)


@METHODS.register(
    "cat",
    options=CATOptions,
    paper="Xu et al., IEEE TMI 2024",
    doc="baseline: CAT-SD: blended synthetic data, class-aware-temperature KD, multi-scale shifted-feature distillation",
    fidelity=(
        "simplified: no harmonisation network and no StyleGAN-XL backgrounds; old instruments cut from earlier "
        "sessions' labelled images"
    ),
    flags=("uses exemplars",),
)
def cat(o: CATOptions, config: RunConfig) -> Method:
    """CAT-SD: blended synthetic data, class-aware temperature KD and shifted-feature distillation."""
    if not o.scales or not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in o.scales):
        raise ConfigError(f"method_args.cat.scales={o.scales!r}: must be a list of positive integers")
    plugin = CATPlugin(o, freeze_policy(o.freeze))
    return Method(
        "cat", [plugin], "CAT-SD: blended synthetic data + class-aware temperature KD + shifted-feature distillation"
    )
