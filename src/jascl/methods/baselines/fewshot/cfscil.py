"""C-FSCIL: a hyperdimensional projection, an explicit memory of bundled prototypes, sharpened cosine prediction.

Hersche, Karunaratne, Cherubini, Benini, Sebastian, Rahimi, "Constrained
Few-shot Class-incremental Learning", CVPR 2022 (arXiv 2203.16588; official
code github.com/IBM/constrained-FSCIL, ``lib/model.py``, ``lib/nudging.py``,
``lib/run_FSCIL.py``, ``lib/torch_blocks.py``; defaults from its ``main.py``
and README commands).

The paper's architecture: a feature extractor (FE), a fully connected layer
(FCL) into a d-dimensional ("hyperdimensional") space, and an explicit memory
(EM) holding one prototype per class. Here, per pixel:

* **FCL**: an affine map ``z = W f + b`` from the backbone's C feature channels
  to d = 512 dimensions (official ``dim_features``), applied to every pixel /
  voxel of the (B, C, *spatial) features (:func:`project`).
* **Similarity**: ``cos(rho(z), rho(p))`` with rho = tanh (official
  ``representation tanh``; :func:`cosine_similarity`), sharpened by the soft
  absolute value ``softabs(x) = sigmoid(s (x - 1/2)) + sigmoid(s (-x - 1/2))``,
  s = 10, while training and by ``|x|`` at inference (official
  ``sharpening_activation`` softabs / abs; :func:`sharpen`).
* **Bundling**: a class prototype is the mean of the projected activations of
  its support pixels (:func:`bundle`). Because the FCL is affine, that equals the
  FCL applied to the class's mean backbone activation, which is what the
  official code stores (the "globally averaged activation memory", GAAM); the
  GAAM here is the mean feature over the class's labelled pixels of a session.
* **Base session (meta-learning)** -- the method trains its own base model
  (``changes_base_session``). The paper pretrains FE + FCL with cross-entropy,
  then meta-learns them on episodes: support prototypes are bundled without
  gradient, query samples are scored by the sharpened, sum-normalised
  similarities, trained with binary cross-entropy against the one-hot label
  (official ``metatrain_baseFSCIL``; :func:`attention_loss`). Here the first
  ``pretrain_fraction`` of the base epochs train with the loop's DiceCE ("seg",
  the pretraining), the rest with the episodic loss ("cfscil_meta",
  :func:`episode_loss`): in every batch the first half of the samples is the
  support set (its pixels bundled per class, background included, detached), the
  other half the query set (every labelled pixel of a class present in the
  support is a query); the query loss weighs every class the same
  (``balance_classes``), as the official class-balanced episodes do. The softabs sharpening makes the prototypes of
  different classes quasi-orthogonal (a similarity of 0, not -1, is what the
  loss asks for between classes).
* **Every session, after training** (the official ``align``): the GAAM of every
  class labelled in the session (background included) is added to the memory,
  every prototype is recomputed as ``FCL(GAAM)`` and, by mode:

  - mode 1: nothing more (prototypes are the bundled activations);
  - mode 2: the prototypes are bipolarised (sign) and the FCL is retrained for
    10 iterations towards them;
  - mode 3 (default, the paper's most accurate): the prototypes are *nudged*
    for 100 iterations (SGD lr 0.1, Nesterov momentum 0.9) to minimise the
    quasi-orthogonality + deviation objective (:func:`nudging_loss`)::

        L = mean_{i<j} (e^{4 c_ij} + e^{-4 c_ij} - 2) + mean_i (1 - cos(tanh p_i, tanh p_i^0))

    with c_ij the cosine of the tanh'd candidates, then the FCL is retrained for
    50 iterations (SGD lr 0.01, Nesterov momentum 0.9, weight decay 5e-4) to map
    each GAAM onto its nudged prototype (:func:`retrain_loss`,
    ``-mean cos(tanh FCL(GAAM_i), tanh p_i)``);

  and the memory is refilled with ``FCL(GAAM)``.
* **Incremental sessions**: the backbone is frozen (``all_but_classifier``) and
  nothing is trained by the loop (its optimiser has learning rate 0, as in
  FeCAM: the loop's DiceCE is computed on the unused pixel classifier and
  changes nothing); learning a session's classes is the fixed-cost update above.
* **Prediction**: between ``before_eval`` and ``after_eval`` the pixel classifier
  is replaced by a :class:`CFSCILHead`: features -> FCL -> sharpened similarity
  to every memory entry; a class's score is its best entry's. The checkpoint keeps
  the standard layout; the FCL, the GAAM and the memory are plugin state
  (``extra_state``).

Adaptations to dense segmentation and deviations, with reasons:

* Pixels (voxels) replace images: support = labelled pixels, GAAM = mean over a
  class's pixels, prediction per pixel; the background is a class like any
  other. 2D and 3D share the code path.
* A class labelled in several sessions (a recurring class in a new domain, the
  background of every session) keeps one memory entry per (session, class), as
  the repository's prototype store does; a class scores by its best entry, and
  nudging only separates entries of *different* classes (the official memory has
  one entry per class; its GAAM of a repeated class would be summed).
* Episodes come from the loop's batches (first half support, second half query;
  a batch of one sample is its own support and query) instead of the official
  60-way 5-shot episode sampler; support activations are detached (the official
  support pass runs under ``no_grad``) but come from the training forward
  (train-mode normalisation) rather than a second eval-mode pass, to save a
  forward. Query pixels of classes absent from the support are left out; a batch
  whose support shows fewer than two classes adds a zero term. The loss is the
  mean over the query's classes of the mean over their pixels: a plain mean over
  pixels (``balance_classes=False``) is dominated by the background and gave a
  base of 0.320 mean foreground Dice on synthetic-2d (seed 1024, 40 epochs)
  against 0.583 balanced, with the same training otherwise.
* Support prototypes are means, not sums, of activations: with thousands of
  pixels a sum would saturate tanh (the official 5-shot sums differ from the
  mean by a factor of 5 only).
* The pretraining head is the model's pixel classifier on the backbone features
  (the loop's DiceCE) rather than a linear layer after the FCL; the pretraining
  / meta-learning split of the base epochs (``pretrain_fraction`` 0.5) is ours
  (the official 120 pretraining epochs and 70,000 episodes do not translate to
  a per-session epoch budget). Pretraining and meta-learning use the run
  configuration's optimiser and schedule (official: SGD lr 0.01, Nesterov), over
  the model and the FCL.
* The retraining optimiser is created afresh for each session (the official one
  is created once and keeps its momentum across sessions); the alignment also
  runs after the base session, as the official evaluation does.
* Training-free incremental sessions run the loop's epochs with learning rate 0,
  so no loss term of this plugin acts in them (``loss_terms`` is empty; its
  "cfscil_meta" term acts in session 0 only and is declared in ``base_loss_terms``).
* The HRR compression of the memory (an official option, off by default) is not
  offered.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from jascl import distributed
from jascl.engine.defaults import default_supervised_loss
from jascl.engine.plugin import Method, Plugin
from jascl.engine.prototypes import align_labels
from jascl.methods.baselines.fewshot._hyperdimensional import (
    cosine_similarity,
    episode_loss,
    nudge_prototypes,
    project,
    retrain_loss,
    sharpen,
)
from jascl.methods.baselines.fewshot._shared import eval_features
from jascl.methods.common import labelled_loader
from jascl.methods.options import check_options, option
from jascl.methods.registry import METHODS

if TYPE_CHECKING:
    from jascl.engine.config import RunConfig
    from jascl.engine.state import LoopState

#: score of a seen class without a memory entry (finite, so softmax stays defined)
NO_CLASS_SCORE = -1e30
#: official iteration counts and bipolarisation per mode (README evaluation commands)
MODE_DEFAULTS = {1: (0, 0, False), 2: (0, 10, True), 3: (100, 50, False)}  # (nudging_iter, retrain_iter, bipolarize)


# ------------------------------------------------------------------------------------------------ pure functions


def align(
    projection: nn.Linear,
    gaam: torch.Tensor,
    classes: torch.Tensor,
    nudging_iter: int,
    retrain_iter: int,
    bipolarize: bool,
    options: CFSCILOptions,
) -> torch.Tensor:
    """The session update (official ``align``): targets from FCL(GAAM), nudged and/or bipolarised, the FCL
    retrained towards them for ``retrain_iter`` iterations (in place, then left frozen), and the refilled memory
    returned.

    Args:
        projection: the FCL (C -> d), retrained in place.
        gaam: (G, C) mean backbone activation of every memory entry.
        classes: (G,) class of every entry.

    Returns:
        (G, d) the memory FCL(GAAM) after retraining.
    """
    with torch.no_grad():
        targets = projection(gaam).float()
    if nudging_iter > 0:
        targets = nudge_prototypes(
            targets, classes, nudging_iter, options.nudging_lr, options.nudging_act, options.nudging_act_exp
        )
    if bipolarize:
        targets = torch.sign(targets)
    if retrain_iter > 0:
        projection.requires_grad_(True)
        optimizer = torch.optim.SGD(
            projection.parameters(),
            lr=options.retrain_lr,
            momentum=options.retrain_momentum,
            nesterov=options.retrain_momentum > 0,
            weight_decay=options.retrain_weight_decay,
        )
        with torch.enable_grad():
            for _ in range(retrain_iter):
                optimizer.zero_grad()
                retrain_loss(projection(gaam), targets, options.representation).backward()
                optimizer.step()
    projection.requires_grad_(False)
    with torch.no_grad():
        return projection(gaam).float()


class CFSCILHead(nn.Module):
    """FCL + explicit memory, standing in for the pixel classifier during evaluation.

    Args:
        projection: the FCL (C -> d).
        prototypes: (G, d) memory entries.
        rows: (G,) classifier row (index into ``state.seen``) of each entry.
        num_classes: K, rows of the output.
        representation, sharpening, steepness: as in :func:`cosine_similarity` / :func:`sharpen`.

    Forward: (B, C, *spatial) -> (B, K, *spatial), or (N, C) -> (N, K): a row's score is the largest
    sharpened similarity among its entries (the argmax equals that of the official sum-normalised
    weightings); rows without an entry get a very negative constant.
    """

    def __init__(
        self,
        projection: nn.Linear,
        prototypes: torch.Tensor,
        rows: torch.Tensor,
        num_classes: int,
        representation: str = "tanh",
        sharpening: str = "abs",
        steepness: float = 10.0,
    ) -> None:
        super().__init__()
        self.projection = projection
        self.register_buffer("prototypes", prototypes.float())
        self.register_buffer("rows", rows.long())
        self._num_classes = num_classes
        self.representation, self.sharpening, self.steepness = representation, sharpening, steepness
        self.chunk = 1 << 16  # pixels per similarity computation (d-wide activations)

    @property
    def num_classes(self) -> int:
        return self._num_classes

    def scores(self, vectors: torch.Tensor) -> torch.Tensor:
        """(N, C) features -> (N, K) class scores."""
        z = self.projection(vectors.to(self.projection.weight.dtype)).float()
        entry = sharpen(cosine_similarity(z, self.prototypes, self.representation), self.sharpening, self.steepness)
        out = entry.new_full((entry.shape[0], self.num_classes), NO_CLASS_SCORE)
        return out.scatter_reduce(1, self.rows.expand_as(entry), entry, reduce="amax", include_self=True)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        flat = features.movedim(1, -1)
        shape = flat.shape[:-1]
        vectors = flat.reshape(-1, flat.shape[-1])
        chunks = [self.scores(vectors[i : i + self.chunk]) for i in range(0, vectors.shape[0], self.chunk)]
        scores = torch.cat(chunks) if chunks else vectors.new_zeros(0, self.num_classes)
        return scores.reshape(*shape, self.num_classes).movedim(-1, 1)


# ------------------------------------------------------------------------------------------------ plugin


@dataclass
class CFSCILOptions:
    """``method_args.c-fscil`` options (defaults: the official ``main.py`` and README commands).

    Attributes:
        mode: update mode of every session: 1 (bundling only), 2 (FCL retrained towards bipolarised
            prototypes), 3 (prototypes nudged, FCL retrained; the paper's most accurate, default).
        dim: hyperdimensional size d of the FCL output (official ``dim_features`` 512).
        representation: tanh (official) or real: what similarities are computed on.
        sharpening: sharpening while meta-learning (official softabs).
        eval_sharpening: sharpening at inference (official abs).
        sharpening_strength: softabs steepness (official 10).
        pretrain_fraction: share of the base epochs trained with the loop's DiceCE (pretraining) before the
            episodic meta-learning (our choice; see the module docstring).
        balance_classes: every class of an episode's query pixels weighs the same in the meta-learning loss
            (default; the official episodes are class-balanced); False: every pixel does (the background
            dominates; measured on synthetic-2d, seed 1024: base 0.320 instead of 0.583).
        nudging_iter: nudging iterations; None = the mode's official value (0, 0, 100).
        nudging_lr: nudging learning rate (official 0.1).
        nudging_act: nudging penalty, doubleexp or exp (official doubleexp).
        nudging_act_exp: the penalty's exponent a (official 4).
        retrain_iter: FCL retraining iterations; None = the mode's official value (0, 10, 50).
        retrain_lr: FCL retraining learning rate (official 0.01).
        retrain_momentum: its Nesterov momentum (official 0.9).
        retrain_weight_decay: its weight decay (official 5e-4).
    """

    mode: int = option(3, choices=(1, 2, 3))
    dim: int = option(512, ge=1)
    representation: str = option("tanh", choices=("tanh", "real"))
    sharpening: str = option("softabs", choices=("softabs", "abs"))
    eval_sharpening: str = option("abs", choices=("abs", "softabs"))
    sharpening_strength: float = option(10.0, gt=0)
    pretrain_fraction: float = option(0.5, ge=0, le=1)
    balance_classes: bool = option(True)
    nudging_iter: int | None = option(None, ge=0)
    nudging_lr: float = option(0.1, gt=0)
    nudging_act: str = option("doubleexp", choices=("doubleexp", "exp"))
    nudging_act_exp: float = option(4.0, gt=0)
    retrain_iter: int | None = option(None, ge=0)
    retrain_lr: float = option(0.01, ge=0)
    retrain_momentum: float = option(0.9, ge=0, lt=1)
    retrain_weight_decay: float = option(5e-4, ge=0)

    def schedule(self) -> tuple[int, int, bool]:
        """(nudging iterations, retraining iterations, bipolarise) of the mode, with the explicit overrides."""
        nudging, retrain, bipolarize = MODE_DEFAULTS[self.mode]
        return (
            nudging if self.nudging_iter is None else self.nudging_iter,
            retrain if self.retrain_iter is None else self.retrain_iter,
            bipolarize,
        )


class CFSCILPlugin(Plugin):
    """Meta-learned FE + FCL, explicit memory of bundled prototypes, fixed-cost session updates (module docstring)."""

    name = "cfscil"
    changes_base_session = True
    freeze_incremental = "all_but_classifier"  # the FE is frozen after the base session
    replaces = ("supervised-loss",)  # session 0 switches from DiceCE (pretraining) to the episodic loss
    loss_terms: tuple[str, ...] = ()  # incremental sessions train nothing
    base_loss_terms = ("cfscil_meta",)  # the episodic meta-learning term of session 0
    unused_parameters = True  # the pixel classifier gets no gradient while the base session meta-learns

    def __init__(self, options: CFSCILOptions | None = None) -> None:
        self.options = options or CFSCILOptions()
        check_options(self.options, "method_args.c-fscil")
        self.projection: nn.Linear | None = None
        #: (session, class) -> mean backbone activation over the class's labelled pixels (C,)
        self.gaam: dict[tuple[int, int], torch.Tensor] = {}
        #: (session, class) -> its prototype FCL(GAAM) (d,), the explicit memory
        self.memory: dict[tuple[int, int], torch.Tensor] = {}
        self._original: nn.Module | None = None

    # ------------------------------------------------------------- set-up

    def _ensure_projection(self, state: LoopState) -> None:
        if self.projection is None:
            with torch.random.fork_rng(devices=[]):  # seeded initialisation without disturbing the loop's stream
                torch.manual_seed(state.seed)
                self.projection = nn.Linear(state.model.backbone.feature_channels, self.options.dim)
        self.projection.to(state.device)

    def meta_start(self, state: LoopState) -> int:
        """First base epoch trained with the episodic loss (the earlier ones pretrain with DiceCE)."""
        return math.floor(self.options.pretrain_fraction * state.config.epochs_base)

    def before_session(self, state: LoopState) -> None:
        self._ensure_projection(state)
        self.projection.requires_grad_(state.session.index == 0)

    def make_optimizer(self, state: LoopState, params: list, lr: float) -> torch.optim.Optimizer | None:
        if state.session.index > 0:
            return torch.optim.SGD(params, lr=0.0)  # the session's update is the alignment, not the loop
        from jascl.engine.optim import make_optimizer

        return make_optimizer(state.config, [*params, *self.projection.parameters()], lr)

    # ------------------------------------------------------------- training

    def after_forward(self, state: LoopState) -> None:
        if state.session.index > 0 or state.epoch < self.meta_start(state):
            state.losses["seg"] = default_supervised_loss(state)
            return
        features = state.output.features
        rows = align_labels(state.target, features.shape[2:])
        o = self.options
        activations = project(self.projection, features).float()
        state.losses["cfscil_meta"] = episode_loss(
            activations, rows, o.representation, o.sharpening, o.sharpening_strength, o.balance_classes
        )

    def after_backward(self, state: LoopState) -> None:
        if state.session.index == 0:  # the FCL lives outside the model, so outside DistributedDataParallel
            distributed.average_gradients(self.projection.parameters())

    def _collect_gaam(self, state: LoopState) -> None:
        """Mean backbone feature of every class labelled in this session (background included), over its pixels."""
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
            self.gaam[(state.session.index, c)] = (s / counts[c]).float()

    def _update_memory(self, state: LoopState) -> None:
        keys = sorted(k for k in self.gaam if k[0] <= state.session.index)
        if not keys:
            return
        gaam = torch.stack([self.gaam[k] for k in keys]).to(state.device)
        classes = torch.tensor([k[1] for k in keys], device=state.device)
        nudging, retrain, bipolarize = self.options.schedule()
        memory = align(self.projection, gaam, classes, nudging, retrain, bipolarize, self.options)
        self.memory = {k: memory[i].cpu() for i, k in enumerate(keys)}

    def after_training(self, state: LoopState) -> None:
        self.projection.requires_grad_(False)
        self._collect_gaam(state)
        self._update_memory(state)

    def session_restored(self, state: LoopState) -> None:
        if self.projection is None:
            raise RuntimeError(
                "c-fscil: no FCL state for a restored session; its base session must be trained by c-fscil"
            )
        self.projection.to(state.device).requires_grad_(False)
        if not any(k[0] == state.session.index for k in self.gaam):
            self._collect_gaam(state)
            self._update_memory(state)

    # ------------------------------------------------------------- prediction

    def head(self, state: LoopState) -> CFSCILHead:
        """The C-FSCIL classifier over ``state.seen`` from the memory entries of sessions <= the current one."""
        row_of = {c: r for r, c in enumerate(state.seen)}
        keys = sorted(k for k in self.memory if k[0] <= state.session.index and k[1] in row_of)
        if not keys or self.projection is None:
            raise RuntimeError("c-fscil has no memory; was session 0 trained or restored with this method?")
        o = self.options
        return CFSCILHead(
            self.projection,
            torch.stack([self.memory[k] for k in keys]),
            torch.tensor([row_of[k[1]] for k in keys]),
            len(state.seen),
            o.representation,
            o.eval_sharpening,
            o.sharpening_strength,
        ).to(state.device)

    def before_eval(self, state: LoopState) -> None:
        self._original = state.model.classifier
        state.model.classifier = self.head(state)

    def after_eval(self, state: LoopState) -> None:
        if self._original is not None:
            state.model.classifier = self._original
            self._original = None

    # ------------------------------------------------------------- state

    def extra_state(self) -> dict[str, torch.Tensor]:
        if self.projection is None:
            return {}
        out = {f"fcl.{k}": v.detach().cpu() for k, v in self.projection.state_dict().items()}
        for (s, c), v in self.gaam.items():
            out[f"gaam.s{s}.c{c}"] = v
        for (s, c), v in self.memory.items():
            out[f"memory.s{s}.c{c}"] = v
        return out

    def load_extra_state(self, tensors: dict[str, torch.Tensor]) -> None:
        weight = tensors["fcl.weight"]
        self.projection = nn.Linear(weight.shape[1], weight.shape[0])
        self.projection.load_state_dict({"weight": weight, "bias": tensors["fcl.bias"]})
        self.projection.requires_grad_(False)
        self.gaam, self.memory = {}, {}
        for key, value in tensors.items():
            kind, _, rest = key.partition(".")
            if kind in ("gaam", "memory"):
                s, c = rest.split(".")
                getattr(self, kind)[(int(s[1:]), int(c[1:]))] = value.float()


@METHODS.register(
    "c-fscil",
    options=CFSCILOptions,
    paper="Hersche et al., CVPR 2022",
    doc="baseline: hyperdimensional FCL + explicit memory of bundled, quasi-orthogonal prototypes",
    fidelity="faithful",
)
def c_fscil(options: CFSCILOptions, config: RunConfig) -> Method:
    return Method("c-fscil", [CFSCILPlugin(options)], "C-FSCIL: meta-learned FE + FCL, explicit prototype memory")
