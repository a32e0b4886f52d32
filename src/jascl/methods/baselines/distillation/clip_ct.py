"""CLIP-CT: Y. Zhang, X. Li, H. Chen, A. L. Yuille, Y. Liu, Z. Zhou, "Continual Learning for Abdominal Multi-Organ
and Tumor Segmentation", MICCAI 2023 (doi 10.1007/978-3-031-43895-0_4; arXiv 2306.00988; official code
github.com/MrGiovanni/ContinualLearning, model ``swinunetr_partial_v3``). Read here: the abstract and the official
code (model, training and prediction scripts); the paper's full text was not available, so the details below follow
the code where the abstract is silent.

What the paper does, and what this module implements:

* **Light-weight class-specific heads** replace the output layer. The body's features ``f`` feed
  (a) a per-pixel branch ``h = conv1x1(ReLU(GN(f)))`` with ``head_channels`` (8) channels and (b) a global
  branch ``g = Linear(mean_spatial(ReLU(GN(f))))`` of ``global_dim`` (256) values. Each foreground class ``k``
  owns a *controller* ``MLP_k([g, e_k])`` (hidden width 512) that outputs the parameters of a small dynamic head
  applied to ``h`` at every pixel: 1x1 convolutions ``8 -> 8 -> 8 -> 1`` with ReLUs in between
  (:func:`dynamic_heads`). Each head gives one binary (sigmoid) logit per pixel, so a new class adds its own
  controller and leaves the old classes' outputs untouched.
* **CLIP embeddings** ``e_k``: the CLIP text embedding of the class name (the paper's "CLIP" variant), read
  from ``method_args.clip-ct.embeddings`` (a safetensors file keyed by class name, written by
  ``jascl text-embeddings``; :func:`jascl.networks.text_embeddings.load_text_embeddings`).
* **Pseudo-labels** against the background shift: in session ``t > 0`` the model of session ``t-1`` (body and
  heads, frozen) predicts the old classes on the new session's images; an old class not taught again is a
  positive wherever the old head's sigmoid exceeds 0.5 on a pixel labelled background
  (:func:`clip_ct_targets`; the official code predicts these masks before training, ``predict.py``: sigmoid
  > 0.5). Pixels labelled with a class of the session are negatives for every other class.
* **Loss**: per-class binary cross-entropy + binary soft Dice (smooth 1) over the foreground classes, averaged
  over (sample, class) pairs (:func:`binary_segmentation_losses`; official ``Multi_BCELoss`` + ``DiceLoss``),
  weighted by the run's ``lambda_ce`` / ``lambda_dice``. It replaces the loop's DiceCE in every session: the
  method trains its own base model (the heads exist from session 0).

Deviations, for dense segmentation under joint nonstationarity in this library:

* **Without an embeddings file** (``encoding=auto``, the default) the class embeddings are one-hot vectors
  over the protocol's foreground classes -- the paper's own CLIP-free ablation ("one-hot" embeddings,
  official ``swinunetr_partial_onehot``) -- and a warning says so; ``encoding=clip`` makes the file
  mandatory (a missing file or class name is a one-line error naming the file). The paper's numbers use
  CLIP embeddings: set ``method_args.clip-ct.embeddings`` to reproduce them.
* Both branches read the backbone's final features (any jascl backbone, 2D or 3D); the official network
  takes the global branch from the Swin-UNETR bottleneck, which not every backbone names.
* Evaluation in jascl takes an argmax over one score per class (background row 0). The background's score is
  a constant 0, so a pixel is background exactly when every head's sigmoid is below 0.5 (the paper's
  threshold), and overlapping positives go to the largest logit (the official post-processing writes classes
  in order, the last one winning).
* Classes taught again in a new domain (recurring) are supervised with their labels, not pseudo-labels.
* ``confidence`` (> 0.5) optionally ignores an old class's pseudo-label on background pixels where the old
  head is unsure (``max(p, 1-p) < confidence``); the paper uses the hard 0.5 threshold only (the default,
  0.5, ignores nothing).
* The run's optimiser and schedule apply (official: AdamW, lr 1e-4, warm-up cosine schedule); the official
  organ-wise post-processing (largest connected components) is not applied.

Implementation: during each session the model's classifier is the :class:`CLIPCTHead` (so the loop trains and
evaluates through it); after the session the original classifier is put back, so checkpoints keep the standard
layout, and the head is saved as plugin state.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from jascl.engine.losses import binary_segmentation_losses
from jascl.engine.plugin import Method, Plugin
from jascl.errors import ConfigError
from jascl.methods.baselines.distillation._shared import absorbed_rows
from jascl.methods.common import frozen_copy
from jascl.methods.options import check_options, freeze_option, freeze_policy, option
from jascl.methods.registry import METHODS
from jascl.networks.clip_driven import dynamic_heads, head_param_count, onehot_embeddings
from jascl.networks.text_embeddings import load_text_embeddings
from jascl.protocols.schema import IGNORE_INDEX

if TYPE_CHECKING:
    from jascl.engine.config import RunConfig
    from jascl.engine.state import LoopState
    from jascl.networks.base import Segmenter

log = logging.getLogger("jascl")


# ------------------------------------------------------------------------------------------------ pure functions


def clip_ct_targets(
    target: torch.Tensor,
    num_rows: int,
    old_rows: Sequence[int] = (),
    teacher_probs: torch.Tensor | None = None,
    confidence: float = 0.5,
    ignore_index: int = IGNORE_INDEX,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Binary targets of the foreground heads: labels, plus pseudo-labels of the old classes not taught again.

    For every foreground row ``r`` (1..K-1), ``y_r = [target == r]``. For an old row in ``old_rows`` (hidden in the
    background this session), a pixel labelled background is a positive when the old model's probability
    ``p_r > 0.5``; with ``confidence > 0.5`` such a pixel is ignored for row ``r`` when ``max(p_r, 1-p_r) <
    confidence``. Ignored pixels (``ignore_index``) are ignored for every row.

    Args:
        target: (B, *spatial) classifier rows, ``ignore_index`` = ignore.
        num_rows: K, background included.
        old_rows: rows (>= 1) whose background pixels take the old model's pseudo-labels.
        teacher_probs: (B, len(old_rows), *spatial) the old model's sigmoid probabilities of those rows.
        confidence: 0.5 = the hard threshold only (the paper); higher ignores unsure pseudo-labels.

    Returns:
        targets (B, K-1, *spatial) float in {0, 1} and valid (B, K-1, *spatial) bool, channel ``i`` = row ``i+1``.
    """
    rows = torch.arange(1, num_rows, device=target.device).view(1, -1, *([1] * (target.dim() - 1)))
    labels = target.unsqueeze(1)
    y = labels == rows
    valid = (labels != ignore_index).expand_as(y).clone()
    if old_rows:
        if teacher_probs is None or teacher_probs.shape[1] != len(old_rows):
            raise ValueError("teacher_probs must hold one channel per old row")
        background = target == 0
        for i, r in enumerate(old_rows):
            p = teacher_probs[:, i]
            y[:, r - 1] = torch.where(background, p > 0.5, target == r)
            if confidence > 0.5:
                sure = torch.maximum(p, 1 - p) >= confidence
                valid[:, r - 1] &= ~background | sure
    return y.to(torch.float32), valid


def _groups(channels: int, wanted: int = 16) -> int:
    return math.gcd(channels, wanted)


class ClassController(nn.Module):
    """One class's controller: ``MLP([g, e_k])`` -> the parameters of its dynamic head; ``e_k`` a fixed buffer."""

    def __init__(self, embedding: torch.Tensor, global_dim: int, hidden: int, num_params: int) -> None:
        super().__init__()
        self.register_buffer("embedding", embedding.detach().clone().float())
        self.mlp = nn.Sequential(
            nn.Linear(global_dim + embedding.numel(), hidden), nn.ReLU(), nn.Linear(hidden, num_params)
        )

    def forward(self, g: torch.Tensor) -> torch.Tensor:
        return self.mlp(torch.cat([g, self.embedding.expand(g.shape[0], -1)], dim=1))


class CLIPCTHead(nn.Module):
    """The class-specific heads of CLIP-CT, as a classifier: features (B, C, *spatial) -> logits (B, K, *spatial).

    Row 0 (background) is a constant 0; row ``i >= 1`` is the binary logit of class ``classes[i-1]`` (see the
    module docstring). Controllers are kept per global class id; :meth:`add_class` appends one.
    """

    def __init__(self, in_channels: int, global_dim: int = 256, hidden: int = 512, head_channels: int = 8) -> None:
        super().__init__()
        self.in_channels, self.global_dim, self.hidden, self.head_channels = (
            in_channels,
            global_dim,
            hidden,
            head_channels,
        )
        self.pixel_norm = nn.GroupNorm(_groups(in_channels), in_channels)
        self.pixel_proj = nn.Linear(in_channels, head_channels)
        self.global_norm = nn.GroupNorm(_groups(in_channels), in_channels)
        self.global_proj = nn.Linear(in_channels, global_dim)
        self.controllers = nn.ModuleDict()

    @property
    def classes(self) -> list[int]:
        return [int(k) for k in self.controllers]

    @property
    def num_classes(self) -> int:
        return len(self.controllers) + 1

    def add_class(self, class_id: int, embedding: torch.Tensor) -> None:
        """A controller for ``class_id`` with the (D,) embedding (initialised from the global random stream)."""
        self.controllers[str(class_id)] = ClassController(
            embedding, self.global_dim, self.hidden, head_param_count(self.head_channels)
        )

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        if features.dim() < 3:
            raise ValueError("CLIP-CT heads need spatial features (B, C, *spatial)")
        x = F.relu(self.pixel_norm(features))
        h = torch.einsum("bc...,oc->bo...", x, self.pixel_proj.weight)
        h = h + self.pixel_proj.bias.view(1, -1, *([1] * (h.dim() - 2)))
        g = self.global_proj(F.relu(self.global_norm(features)).flatten(2).mean(-1))
        background = features.new_zeros(features.shape[0], 1, *features.shape[2:])
        if not len(self.controllers):
            return background
        params = torch.stack([controller(g) for controller in self.controllers.values()], dim=1)
        return torch.cat([background, dynamic_heads(h, params)], dim=1)


# ------------------------------------------------------------------------------------------------ plugin


@dataclass
class CLIPCTOptions:
    """Options of ``clip-ct`` (defaults: the official code, model ``swinunetr_partial_v3``).

    Attributes:
        embeddings: safetensors file of CLIP text embeddings keyed by class name (``jascl text-embeddings``);
            "" = none.
        encoding: "clip" (the file is required), "onehot" (the paper's CLIP-free ablation) or "auto" (clip
            when ``embeddings`` is set, else one-hot with a warning).
        confidence: old-class pseudo-labels on background pixels are ignored where the old head's
            ``max(p, 1-p)`` is below this (0.5 = the paper's hard threshold, nothing ignored).
        global_dim: width of the global image feature fed to the controllers (official 256).
        hidden: hidden width of each class's controller (official 512).
        head_channels: channels of the dynamic heads (official 8: 8 -> 8 -> 8 -> 1).
        freeze: incremental-session freezing ("none": the paper fine-tunes the whole network).
    """

    embeddings: str = ""
    encoding: str = option("auto", choices=("auto", "clip", "onehot"))
    confidence: float = option(0.5, ge=0.5, lt=1.0)
    global_dim: int = option(256, ge=1)
    hidden: int = option(512, ge=1)
    head_channels: int = option(8, ge=1)
    freeze: str = freeze_option("none")


class CLIPCTPlugin(Plugin):
    """CLIP-CT (Zhang et al., MICCAI 2023): class-specific CLIP-conditioned heads and old-model pseudo-labels."""

    name = "clip-ct"
    replaces = ("supervised-loss",)  # per-class BCE + Dice on the heads' binary outputs
    changes_base_session = True  # the heads are trained from session 0
    loss_terms = ("clipct_bce", "clipct_dice")
    base_loss_terms = ("clipct_bce", "clipct_dice")
    snapshot_exclude = ("teacher", "_original", "_old_rows")  # rebuilt by before_session from the session's start

    def __init__(self, options: CLIPCTOptions | None = None) -> None:
        self.options = options or CLIPCTOptions()
        check_options(self.options, "method_args.clip-ct")
        self.freeze_incremental = freeze_policy(self.options.freeze)
        self.head: CLIPCTHead | None = None
        self.teacher: Segmenter | None = None
        self._original: nn.Module | None = None
        self._old_rows: list[int] = []

    # ------------------------------------------------------------- embeddings

    def uses_clip(self) -> bool:
        return self.options.encoding == "clip" or (self.options.encoding == "auto" and bool(self.options.embeddings))

    def class_embeddings(self, state: LoopState, classes: Sequence[int]) -> torch.Tensor:
        """(len(classes), D) embeddings of the classes: CLIP vectors from the file, or one-hot vectors."""
        if self.uses_clip():
            if not self.options.embeddings:
                raise ConfigError(
                    "method_args.clip-ct.encoding=clip needs method_args.clip-ct.embeddings (a safetensors file "
                    "written by `jascl text-embeddings`)"
                )
            names = [state.protocol.class_name(c) for c in classes]
            return load_text_embeddings(self.options.embeddings, names)
        foreground = [c for c in state.protocol.seen_classes(len(state.protocol.sessions) - 1) if c != 0]
        return onehot_embeddings(foreground, classes)

    # ------------------------------------------------------------- events

    def _grow_head(self, state: LoopState) -> None:
        """Create the head (session 0) and a controller per new class, seeded by (seed, session)."""
        new = [c for c in state.seen if c != 0 and (self.head is None or c not in self.head.classes)]
        embeddings = self.class_embeddings(state, new) if new else None
        if new and self.options.encoding == "auto" and not self.uses_clip():
            log.warning(
                "clip-ct: no method_args.clip-ct.embeddings file; class embeddings are one-hot (the paper's "
                "CLIP-free ablation), not CLIP text embeddings"
            )
        if embeddings is not None and self.head is not None and self.head.classes:
            have = self.head.controllers[str(self.head.classes[0])].embedding.numel()
            if embeddings.shape[1] != have:
                raise ConfigError(
                    f"method_args.clip-ct: the class embeddings of session {state.session.index} have dimension "
                    f"{embeddings.shape[1]}, the earlier sessions' heads {have}; use the same embeddings (or "
                    "encoding) in every session"
                )
        with torch.random.fork_rng(devices=[]):  # seeded initialisation, the loop's random stream untouched
            torch.manual_seed(state.seed * 1000 + state.session.index)
            if self.head is None:
                o = self.options
                self.head = CLIPCTHead(state.model.backbone.feature_channels, o.global_dim, o.hidden, o.head_channels)
            for i, c in enumerate(new):
                assert embeddings is not None
                self.head.add_class(c, embeddings[i])
        if self.head.classes != [c for c in state.seen if c != 0]:
            raise ValueError(f"clip-ct heads {self.head.classes} do not follow the classifier rows {state.seen}")
        self.head.to(state.device)

    def before_session(self, state: LoopState) -> None:
        self.teacher, self._old_rows = None, []
        if state.session.index > 0 and self.head is not None:
            # the previous session's model: its body and its heads (old classes only), frozen
            teacher = frozen_copy(state)
            teacher.classifier = copy.deepcopy(self.head).eval().requires_grad_(False)
            self.teacher = teacher
            self._old_rows = [r for r in absorbed_rows(state) if r > 0]
        self._grow_head(state)
        assert self.head is not None
        self.head.requires_grad_(True)  # the loop collects the trainable parameters after this event
        self._original = state.model.classifier
        state.model.classifier = self.head

    def after_forward(self, state: LoopState) -> None:
        assert state.output is not None and state.target is not None
        logits = state.output.logits
        probs = None
        if self.teacher is not None and self._old_rows:
            with torch.no_grad():
                old = self.teacher.forward_features(state.batch["image"].to(state.device)).logits
                probs = torch.sigmoid(old[:, self._old_rows].float())
        targets, valid = clip_ct_targets(state.target, logits.shape[1], self._old_rows, probs, self.options.confidence)
        bce, dice = binary_segmentation_losses(logits[:, 1:].float(), targets, valid)
        state.losses["clipct_bce"] = state.config.lambda_ce * bce
        state.losses["clipct_dice"] = state.config.lambda_dice * dice

    def after_session(self, state: LoopState) -> None:
        if self._original is not None:
            state.model.classifier = self._original
        self._original = None
        self.teacher = None
        if self.head is not None:
            self.head.requires_grad_(False)

    # ------------------------------------------------------------- state across sessions

    def extra_state(self) -> dict[str, torch.Tensor]:
        if self.head is None:
            return {}
        out = {f"head.{k}": v.detach().cpu() for k, v in self.head.state_dict().items()}
        out["classes"] = torch.tensor(self.head.classes, dtype=torch.long)
        out["dims"] = torch.tensor(
            [self.head.in_channels, self.head.global_dim, self.head.hidden, self.head.head_channels]
        )
        return out

    def load_extra_state(self, tensors: dict[str, torch.Tensor]) -> None:
        if "classes" not in tensors:
            return
        in_channels, global_dim, hidden, head_channels = (int(v) for v in tensors["dims"])
        head = CLIPCTHead(in_channels, global_dim, hidden, head_channels)
        for c in tensors["classes"].tolist():
            head.add_class(int(c), tensors[f"head.controllers.{int(c)}.embedding"])
        head.load_state_dict({k[len("head.") :]: v for k, v in tensors.items() if k.startswith("head.")})
        self.head = head.requires_grad_(False)


@METHODS.register(
    "clip-ct",
    options=CLIPCTOptions,
    paper="Zhang et al., MICCAI 2023",
    doc="baseline: class-specific CLIP-conditioned heads (sigmoid) + old-model pseudo-labels",
    fidelity=(
        "simplified: abstract and official code only; embeddings from a file (one-hot codes without one); no "
        "connected-component post-processing"
    ),
)
def clip_ct(options: CLIPCTOptions, config: RunConfig) -> Method:
    """CLIP-CT: per-class dynamic heads generated from CLIP text embeddings, old classes kept by pseudo-labels."""
    return Method("clip-ct", [CLIPCTPlugin(options)], "CLIP-CT: class-specific CLIP heads and pseudo-labels")
