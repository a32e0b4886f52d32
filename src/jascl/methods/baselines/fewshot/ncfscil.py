"""NC-FSCIL: a fixed simplex-ETF classifier, a learnable projection head and the dot-regression loss.

Yang, Yuan, Li, Wu, Zhang, Lin, Torr, Tao, Ghanem, "Neural Collapse Inspired
Feature-Classifier Alignment for Few-Shot Class-Incremental Learning", ICLR
2023 (official code github.com/NeuralCollapseApplications/FSCIL).

What it does:

* Before any training, one classifier prototype per class *of the whole
  protocol* (background and every future class) is fixed as a simplex
  equiangular tight frame (paper eq. 1)::

      W = sqrt(K / (K-1)) U (I_K - 1_K 1_K^T / K),   U in R^{d x K}, U^T U = I_K

  whose columns have unit norm and pairwise cosine -1/(K-1).
* A projection head g (the official ``MLPFFNNeck``: two Linear-LayerNorm-
  LeakyReLU(0.1) blocks of width 2C, a bias-free output layer, plus a bias-free
  linear shortcut) maps backbone features to d dimensions; applied per pixel
  here (1x1 convolutions in effect).
* Every session is trained with the dot-regression loss (paper eq. 7 /
  official ``DRLoss``, weight 10) between the normalised projected feature
  mu = g(f)/|g(f)| and its class's fixed prototype w_y::

      L_DR = 1/2 (w_y^T mu - 1)^2

  With ``class_balance`` (the official incremental configuration's
  ``with_len``), each term is weighted by gamma / n_y, gamma = N / #classes
  present, so every class present carries the same total weight.
* Session 0 trains backbone + head (so the method trains its own base model);
  incremental sessions freeze the backbone and fine-tune the head only, on
  the session's pixels plus a memory of one mean backbone feature per old
  class (the official ``proto_memory`` / ``mean_neck_feat``).
* Prediction: argmax over the seen classes of w_k^T mu (times the configured
  cosine temperature, which does not change the argmax).

Implementation: during each session the model's classifier is temporarily
replaced by an :class:`ETFClassifier` (head + fixed prototypes); after the
session the original classifier is put back, so checkpoints keep the standard
layout, and the head, the prototypes and the memory are saved as plugin state.

Deviations:

* By default the DR loss *replaces* the loop's DiceCE (``replace_seg``), as in
  the paper (the loop's term is dropped from ``state.losses``).
* Mixup/CutMix base-session augmentation, the cosine learning-rate schedule
  and the official optimiser (SGD lr 0.25 in incremental sessions) are not
  reproduced: the run configuration's optimiser and schedule apply.
* Per-pixel features replace per-image pooled features; the memory holds one
  mean backbone feature per (session, class), background included, computed
  over the class's labelled pixels.
* d defaults to max(C, K) (the ETF needs d >= K), not the official 512.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from jascl.engine.plugin import Method, Plugin
from jascl.engine.prototypes import align_labels
from jascl.errors import ConfigError
from jascl.methods.baselines.fewshot._shared import eval_features
from jascl.methods.common import labelled_loader
from jascl.methods.options import check_options, option
from jascl.methods.registry import METHODS
from jascl.protocols.schema import IGNORE_INDEX

if TYPE_CHECKING:
    from jascl.engine.config import RunConfig
    from jascl.engine.state import LoopState


def simplex_etf(num_classes: int, dim: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """A (dim, K) simplex equiangular tight frame (paper eq. 1, official ``ETFHead``).

    Columns have unit norm and pairwise inner product -1/(K-1).

    Raises:
        ValueError: if dim < K or K < 2.
    """
    if num_classes < 2:
        raise ValueError(f"a simplex ETF needs at least 2 classes (got {num_classes})")
    if dim < num_classes:
        raise ValueError(f"a simplex ETF of {num_classes} classes needs dim >= {num_classes} (got {dim})")
    u, _ = torch.linalg.qr(torch.rand(dim, num_classes, generator=generator, dtype=torch.float64))
    k = num_classes
    centre = torch.eye(k, dtype=torch.float64) - torch.full((k, k), 1.0 / k, dtype=torch.float64)
    return (math.sqrt(k / (k - 1)) * u @ centre).float()


def dot_regression_loss(
    features: torch.Tensor, targets: torch.Tensor, sample_weights: torch.Tensor | None = None
) -> torch.Tensor:
    """Dot-regression loss 1/2 mean_i w_i (<mu_i, t_i> - 1)^2 (paper eq. 7, official ``DRLoss``).

    Args:
        features: (N, d) normalised projected features mu_i.
        targets: (N, d) fixed unit-norm prototypes of each sample's class.
        sample_weights: optional (N,) weights w_i (1 if None).

    Returns:
        Scalar loss (0 for N = 0).
    """
    if features.shape[0] == 0:
        return features.sum() * 0.0
    sq = ((features * targets).sum(dim=1) - 1.0) ** 2
    if sample_weights is not None:
        sq = sq * sample_weights
    return 0.5 * sq.mean()


def class_balance_weights(classes: torch.Tensor) -> torch.Tensor:
    """Per-sample weights gamma / n_y with gamma = N / #distinct classes (official ``with_len`` rectification).

    Args:
        classes: (N,) class index of each sample.

    Returns:
        (N,) weights; each class present gets the same total weight gamma.
    """
    uniq, inverse, counts = torch.unique(classes, return_inverse=True, return_counts=True)
    gamma = classes.numel() / uniq.numel()
    return gamma / counts[inverse].to(torch.float32)


class ProjectionHead(nn.Module):
    """The official ``MLPFFNNeck`` applied per pixel: (B, C, *spatial) or (N, C) -> same with ``out_channels``.

    x -> [Linear(C, 2C) LN LeakyReLU(0.1)] -> [Linear(2C, 2C) LN LeakyReLU(0.1)] -> Linear(2C, d, no bias)
    plus a bias-free linear shortcut C -> d.
    """

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        hidden = 2 * in_channels
        self.in_channels, self.out_channels = in_channels, out_channels
        self.block1 = nn.Sequential(nn.Linear(in_channels, hidden), nn.LayerNorm(hidden), nn.LeakyReLU(0.1))
        self.block2 = nn.Sequential(nn.Linear(hidden, hidden), nn.LayerNorm(hidden), nn.LeakyReLU(0.1))
        self.out = nn.Linear(hidden, out_channels, bias=False)
        self.shortcut = nn.Linear(in_channels, out_channels, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        last = x.movedim(1, -1)  # channels last, so the linear layers act per pixel
        y = self.out(self.block2(self.block1(last))) + self.shortcut(last)
        return y.movedim(-1, 1)


class ETFClassifier(nn.Module):
    """Projection head + fixed ETF prototypes of the seen classes, standing in for the pixel classifier.

    Args:
        head: the projection head g.
        etf: (d, K_all) fixed prototypes, one column per protocol class.
        columns: ETF column of each classifier row (row order = ``state.seen``).
        temperature: logit scale (argmax-neutral).

    Forward: (B, C, *spatial) -> (B, K_seen, *spatial) logits ``temperature * w_k^T mu``;
    (N, C) -> (N, K_seen).
    """

    def __init__(self, head: ProjectionHead, etf: torch.Tensor, columns: list[int], temperature: float) -> None:
        super().__init__()
        self.head = head
        self.register_buffer("prototypes", etf[:, columns].t().contiguous(), persistent=False)  # (K_seen, d)
        self.temperature = temperature

    @property
    def num_classes(self) -> int:
        return self.prototypes.shape[0]

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """Normalised projected features mu, channels in dim 1."""
        return F.normalize(self.head(features), dim=1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        mu = self.project(features)
        if mu.dim() == 2:
            return self.temperature * mu @ self.prototypes.t()
        return self.temperature * torch.einsum("bd...,kd->bk...", mu, self.prototypes)


@dataclass
class NCFSCILOptions:
    """``method_args.nc-fscil`` options (defaults: official code / configs).

    Attributes:
        weight: DR loss weight (official ``loss_weight`` = 10).
        proj_dim: projection (ETF) dimension d; 0 = max(feature channels, number of protocol classes).
        class_balance: weight DR terms by gamma / n_y (official incremental ``with_len``; also used in session 0 here,
            where pixel classes are as imbalanced).
        memory: replay one mean backbone feature per old (session, class) in incremental sessions (official).
        replace_seg: drop the loop's DiceCE term, training with DR only (paper); False adds DR to it.
    """

    weight: float = 10.0
    proj_dim: int = option(0, ge=0)
    class_balance: bool = True
    memory: bool = True
    replace_seg: bool = True


class NCFSCILPlugin(Plugin):
    """Fixed simplex-ETF classifier + projection head trained with the DR loss (see module docstring)."""

    name = "ncfscil"
    loss_terms = ("ncfscil_dr",)
    changes_base_session = True
    freeze_incremental = "all_but_classifier"  # official: the backbone is frozen after the base session

    def __init__(self, options: NCFSCILOptions | None = None) -> None:
        self.options = options or NCFSCILOptions()
        if self.options.replace_seg:  # trained with the DR loss alone (paper)
            self.replaces = ("supervised-loss",)
        check_options(self.options, "method_args.nc-fscil")
        self.head: ProjectionHead | None = None
        self.etf: torch.Tensor | None = None
        self.memory: dict[tuple[int, int], torch.Tensor] = {}
        self._columns: dict[int, int] = {}
        self._original: nn.Module | None = None
        self._etf_classifier: ETFClassifier | None = None
        self._mem: tuple[torch.Tensor, torch.Tensor] | None = None

    # ------------------------------------------------------------- set-up

    def _ensure_head(self, state: LoopState) -> None:
        all_classes = state.protocol.seen_classes(len(state.protocol.sessions) - 1)
        self._columns = {c: i for i, c in enumerate(all_classes)}
        channels = state.model.backbone.feature_channels
        dim = self.options.proj_dim or max(channels, len(all_classes))
        if dim < len(all_classes):
            raise ConfigError(
                f"method_args.nc-fscil.proj_dim: {dim} < {len(all_classes)} protocol classes; the ETF "
                f"needs proj_dim >= the number of classes (use 0 for automatic)"
            )
        if self.head is None:
            generator = torch.Generator().manual_seed(state.seed)
            self.etf = simplex_etf(len(all_classes), dim, generator)
            with torch.random.fork_rng(devices=[]):  # seeded initialisation without disturbing the loop's stream
                torch.manual_seed(state.seed)
                self.head = ProjectionHead(channels, dim)
        self.head.to(state.device)

    def _install(self, state: LoopState) -> None:
        columns = [self._columns[c] for c in state.seen]
        self._etf_classifier = ETFClassifier(
            self.head, self.etf.to(state.device), columns, state.config.temperature
        ).to(state.device)
        self._original = state.model.classifier
        state.model.classifier = self._etf_classifier

    def _restore(self, state: LoopState) -> None:
        if self._original is not None:
            state.model.classifier = self._original
        self._original = None
        self._etf_classifier = None

    # ------------------------------------------------------------- events

    def before_session(self, state: LoopState) -> None:
        self._ensure_head(state)
        for p in self.head.parameters():
            p.requires_grad_(True)  # the loop collects trainable parameters after this event
        self._install(state)
        self._mem = None
        if state.session.index > 0 and self.options.memory:
            old = sorted(k for k in self.memory if k[0] < state.session.index)
            if old:
                feats = torch.stack([self.memory[k] for k in old]).to(state.device)
                cols = torch.tensor([self._columns[k[1]] for k in old], device=state.device)
                self._mem = (feats, cols)

    def after_forward(self, state: LoopState) -> None:
        clf = self._etf_classifier
        features = state.output.features
        rows = state.class_index(align_labels(state.batch["label"].to(state.device), features.shape[2:]))
        mu = clf.project(features).movedim(1, -1).reshape(-1, clf.head.out_channels)
        rows = rows.reshape(-1)
        keep = rows != IGNORE_INDEX
        mu, rows = mu[keep], rows[keep]
        row_to_col = torch.tensor([self._columns[c] for c in state.seen], device=state.device)
        cols = row_to_col[rows]
        if self._mem is not None:
            mem_feats, mem_cols = self._mem
            mu = torch.cat([mu, clf.project(mem_feats)])
            cols = torch.cat([cols, mem_cols])
        etf = self.etf.to(state.device)
        targets = etf[:, cols].t()
        weights = class_balance_weights(cols) if self.options.class_balance else None
        state.losses["ncfscil_dr"] = self.options.weight * dot_regression_loss(mu, targets, weights)

    def _collect_memory(self, state: LoopState) -> None:
        """Mean backbone feature of every class labelled in this session (incl. background), over its pixels."""
        classes = [0, *state.session.classes]
        sums: dict[int, torch.Tensor] = {}
        counts: dict[int, int] = {}
        for features, labels in eval_features(state, state.model, labelled_loader(state), pieces=True):
            lab = align_labels(labels, features.shape[2:])
            flat = features.movedim(1, -1)
            for c in classes:
                mask = lab == c
                if mask.any():
                    s = flat[mask].double().sum(0).cpu()
                    sums[c] = sums[c] + s if c in sums else s
                    counts[c] = counts.get(c, 0) + int(mask.sum())
        for c, s in sums.items():
            self.memory[(state.session.index, c)] = (s / counts[c]).float()

    def after_training(self, state: LoopState) -> None:
        self._collect_memory(state)

    def after_session(self, state: LoopState) -> None:
        self._restore(state)
        if self.head is not None:
            self.head.requires_grad_(False)

    def session_restored(self, state: LoopState) -> None:
        if not any(k[0] == state.session.index for k in self.memory):
            self._collect_memory(state)

    # ------------------------------------------------------------- state

    def extra_state(self) -> dict[str, torch.Tensor]:
        if self.head is None:
            return {}
        out = {f"head.{k}": v.detach().cpu() for k, v in self.head.state_dict().items()}
        out["etf"] = self.etf.cpu()
        for (s, c), v in self.memory.items():
            out[f"memory.s{s}.c{c}"] = v
        return out

    def load_extra_state(self, tensors: dict[str, torch.Tensor]) -> None:
        self.etf = tensors["etf"].float()
        head_state = {k[len("head.") :]: v for k, v in tensors.items() if k.startswith("head.")}
        dim, channels = head_state["shortcut.weight"].shape
        self.head = ProjectionHead(channels, dim)
        self.head.load_state_dict(head_state)
        self.memory = {}
        for key, value in tensors.items():
            if key.startswith("memory."):
                s, c = key[len("memory.") :].split(".")
                self.memory[(int(s[1:]), int(c[1:]))] = value.float()


@METHODS.register(
    "nc-fscil",
    options=NCFSCILOptions,
    paper="Yang et al., ICLR 2023",
    doc="baseline: fixed simplex-ETF classifier + projection head, DR loss",
    fidelity="faithful",
)
def nc_fscil(options: NCFSCILOptions, config: RunConfig) -> Method:
    return Method("nc-fscil", [NCFSCILPlugin(options)], "NC-FSCIL: neural-collapse-inspired fixed ETF classifier")
