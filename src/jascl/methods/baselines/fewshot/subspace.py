"""Subspace regularisers for few-shot class-incremental learning.

Akyurek, Akyurek, Kelly Wijaya, Andreas, "Subspace Regularizers for Few-Shot
Class Incremental Learning", ICLR 2022 (official code
github.com/feyzaakyurek/subspace-reg; defaults from
``scripts/continual/slurm_subspace_reg.sh``, the plain "subspace" variant,
``attraction_override distance2subspace``; the semantic variant needs label
word embeddings and is not implemented).

What it does, per incremental session (the backbone is frozen; only the
classifier trains):

* new classifier rows start at random (the official ``augment_base_classifier_``
  draws them like a fresh linear layer), replacing the loop's imprinting;
* the loss adds to the segmentation loss of the session's images

  - ``lambda_base * ||W_base - W_base^*||_F`` (rows of the base classes, anchored
    at the end of the base session; official ``regloss``, weight 0.2),
  - ``lambda_novel * ||W_prev - W_prev^*||_F`` (rows of classes introduced in
    earlier incremental sessions, anchored at the end of the session that
    introduced them; official ``reglossnovel``, weight 0.1),
  - ``lambda_pull * ||W_new - W_new Q Q^T||_F^2`` (paper eq. 5: the squared
    distance of the new rows to the subspace spanned by the base rows, with Q
    an orthonormal basis of that span from a QR decomposition; weight 1),
  - a replay cross-entropy on a memory of ``exemplars`` labelled images per
    class of earlier sessions (official ``n_base_support_samples 1`` and
    ``memory_replay 1``).

Deviations:

* Segmentation has a background row; it counts as a base class (anchored,
  part of the subspace).
* The memory holds whole labelled images (one per class, chosen at random
  among the session's images showing it) with the training labels of their
  session; their cross-entropy is one separate term (officially the base
  exemplars join the support batch and the novel ones a separate term).
* The official stopping rule (fine-tune until the training loss is stable)
  and optimiser (SGD lr 0.002, weight decay 5e-4) are replaced by the run
  configuration's epochs and optimiser; the classifier is the configured
  (cosine) one instead of a linear layer with bias.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from jascl.engine.plugin import Method, Plugin
from jascl.methods.common import labelled_loader, patch_around
from jascl.methods.options import check_options, option
from jascl.methods.registry import METHODS

if TYPE_CHECKING:
    from jascl.engine.config import RunConfig
    from jascl.engine.state import LoopState


def subspace_distance(new_rows: torch.Tensor, base_rows: torch.Tensor) -> torch.Tensor:
    """Squared Frobenius distance of ``new_rows`` to the span of ``base_rows`` (paper eq. 5).

    Args:
        new_rows: (N, C) classifier rows of the session's new classes.
        base_rows: (B, C) anchored base-class rows spanning the subspace.

    Returns:
        Scalar ||W - W Q Q^T||_F^2, Q (C, r) an orthonormal basis of the rows' span.
    """
    q, _ = torch.linalg.qr(base_rows.t())  # (C, min(C, B)); columns span the base rows
    projected = new_rows @ q @ q.t()
    return (new_rows - projected).pow(2).sum()


def anchor_distance(rows: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """Frobenius norm ||W - W^*||_F (not squared, as the official ``regloss``). (N, C), (N, C) -> scalar."""
    return torch.linalg.matrix_norm(rows - anchors)


@dataclass
class SubspaceOptions:
    """``method_args.subspace`` options (defaults: official ``slurm_subspace_reg.sh``).

    Attributes:
        lambda_base: weight of the base-row anchor (official ``lmbd_reg_transform_w`` = 0.2).
        lambda_novel: weight of the earlier-novel-row anchor (official ``lmbd_reg_novel`` = 0.1).
        lambda_pull: weight of the subspace distance (official ``label_pull`` = 1.0).
        exemplars: labelled images kept per class for replay (official 1 base and 1 novel sample per class; 0 = none).
        random_init: start new rows at random (official) instead of the loop's prototype imprinting.
    """

    lambda_base: float = option(0.2, ge=0)
    lambda_novel: float = option(0.1, ge=0)
    lambda_pull: float = option(1.0, ge=0)
    exemplars: int = option(1, ge=0)
    random_init: bool = True


class SubspacePlugin(Plugin):
    """Anchors on old classifier rows, a subspace pull on new rows and exemplar replay (see module docstring)."""

    name = "subspace"
    freeze_incremental = "all_but_classifier"  # official: the backbone is frozen in incremental sessions

    def __init__(self, options: SubspaceOptions | None = None) -> None:
        o = self.options = options or SubspaceOptions()
        check_options(o, "method_args.subspace")
        terms = [("subspace_base", o.lambda_base), ("subspace_pull", o.lambda_pull), ("subspace_replay", o.exemplars)]
        # the earlier-novel anchor only exists from the second incremental session on (not in a two-session run)
        self.loss_terms = tuple(name for name, weight in terms if weight)
        #: class id -> (session that introduced it, anchored row (C,))
        self.anchors: dict[int, tuple[int, torch.Tensor]] = {}
        self.exemplar_images: list[torch.Tensor] = []
        self.exemplar_labels: list[torch.Tensor] = []
        self.recorded: set[int] = set()  # sessions whose anchors and exemplars are kept
        self._rows: dict[str, list[int]] = {}

    # ------------------------------------------------------------- end of a session

    def _record(self, state: LoopState) -> None:
        """Anchor the rows of the classes introduced in this session and keep exemplars of its classes."""
        t = state.session.index
        self.recorded.add(t)
        weight = state.model.classifier.weight.detach().cpu()
        introduced = [0, *state.session.new_classes] if t == 0 else list(state.session.new_classes)
        for c in introduced:
            self.anchors[c] = (t, weight[state.seen.index(c)].clone())
        if self.options.exemplars == 0:
            return
        rng = np.random.default_rng([state.seed, t, 31337])
        images, labels = [], []
        for batch in labelled_loader(state):
            images.extend(batch["image"])
            labels.extend(batch["label"])
        for c in state.session.classes:
            showing = [i for i, lab in enumerate(labels) if bool((lab == c).any())]
            for i in rng.permutation(showing)[: self.options.exemplars]:
                # a window of the patch's size around the class (whole samples vary in size on real data)
                image, label = patch_around(images[int(i)], labels[int(i)], state.config.patch_size, rng, c)
                self.exemplar_images.append(image.clone())
                self.exemplar_labels.append(label.clone())

    def after_session(self, state: LoopState) -> None:
        self._record(state)

    def session_restored(self, state: LoopState) -> None:
        if state.session.index not in self.recorded:
            self._record(state)

    # ------------------------------------------------------------- incremental sessions

    def before_session(self, state: LoopState) -> None:
        self._rows = {}
        t = state.session.index
        if t == 0:
            return
        row = {c: r for r, c in enumerate(state.seen)}
        new = [c for c in state.session.new_classes]
        if self.options.random_init and new:
            with torch.no_grad():
                fresh = torch.empty(len(new), state.model.classifier.weight.shape[1])
                nn.init.kaiming_uniform_(fresh, a=5**0.5)  # a fresh linear layer's initialisation
                for i, c in enumerate(new):
                    state.model.classifier.weight[row[c]] = fresh[i].to(state.model.classifier.weight)
        self._rows = {
            "base": [row[c] for c, (s, _) in sorted(self.anchors.items()) if s == 0],
            "prev": [row[c] for c, (s, _) in sorted(self.anchors.items()) if 0 < s < t],
            "new": [row[c] for c in new],
        }
        self._anchor = {
            k: torch.stack([self.anchors[state.seen[r]][1] for r in rows]).to(state.device)
            for k, rows in self._rows.items()
            if rows and k != "new"
        }

    def after_forward(self, state: LoopState) -> None:
        if not self._rows:
            return
        o = self.options
        weight = state.model.classifier.weight
        rows = self._rows
        if rows["base"] and o.lambda_base:
            state.losses["subspace_base"] = o.lambda_base * anchor_distance(weight[rows["base"]], self._anchor["base"])
        if rows["prev"] and o.lambda_novel:
            state.losses["subspace_novel"] = o.lambda_novel * anchor_distance(
                weight[rows["prev"]], self._anchor["prev"]
            )
        if rows["new"] and rows["base"] and o.lambda_pull:
            state.losses["subspace_pull"] = o.lambda_pull * subspace_distance(weight[rows["new"]], self._anchor["base"])
        if self.exemplar_images:
            x = torch.stack(self.exemplar_images).to(state.device)
            y = state.class_index(torch.stack(self.exemplar_labels).to(state.device))
            state.losses["subspace_replay"] = F.cross_entropy(state.model(x), y, ignore_index=255)

    # ------------------------------------------------------------- state

    def extra_state(self) -> dict[str, torch.Tensor]:
        out = {"recorded": torch.tensor(sorted(self.recorded), dtype=torch.long)}
        for c, (s, w) in self.anchors.items():
            out[f"anchor.c{c}.s{s}"] = w
        for i, (image, label) in enumerate(zip(self.exemplar_images, self.exemplar_labels)):
            out[f"exemplar.{i}.image"], out[f"exemplar.{i}.label"] = image, label
        return out

    def load_extra_state(self, tensors: dict[str, torch.Tensor]) -> None:
        self.anchors = {}
        self.recorded = set(int(v) for v in tensors.get("recorded", torch.zeros(0, dtype=torch.long)).tolist())
        for key, value in tensors.items():
            if key.startswith("anchor."):
                c, s = key[len("anchor.") :].split(".")
                self.anchors[int(c[1:])] = (int(s[1:]), value)
        n = len([k for k in tensors if k.startswith("exemplar.") and k.endswith(".image")])
        self.exemplar_images = [tensors[f"exemplar.{i}.image"] for i in range(n)]
        self.exemplar_labels = [tensors[f"exemplar.{i}.label"].long() for i in range(n)]


@METHODS.register(
    "subspace",
    options=SubspaceOptions,
    paper="Akyurek et al., ICLR 2022",
    doc="baseline: subspace regulariser on new classifier rows + anchors",
    fidelity="faithful",
    flags=("uses exemplars",),
)
def subspace(options: SubspaceOptions, config: RunConfig) -> Method:
    return Method("subspace", [SubspacePlugin(options)], "Subspace regularisers: new rows pulled to the base-row span")
