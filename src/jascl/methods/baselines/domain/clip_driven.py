"""CLIP-driven: the CLIP-driven universal model fine-tuned over the sessions (the JASCL paper's Med-Mixed row).

Liu, Zhang, Chen, Xiao, Landman, Yuan, Yuille, Tang and Zhou, "CLIP-Driven Universal Model for Organ
Segmentation and Tumor Detection", ICCV 2023 (official code: github.com/ljwztc/CLIP-Driven-Universal-Model).
The universal model conditions one small dynamic head per class on the CLIP text embedding of
"A computerized tomography of a [CLS]" and the image's global feature, predicts one sigmoid mask per
class, and is trained on the union of partially labelled datasets with binary cross-entropy + Dice
computed only on the classes each dataset labels (the others are masked out, so an unlabelled organ
that shows up as background is not taught as background). The JASCL paper fine-tunes this model over
the sessions of Med JASCL-Mixed (table ``backbone_set2``, per class in ``clip_d``), with no further
continual-learning mechanism.

The model is :class:`~jascl.networks.clip_driven.TextDrivenClassifier` (see
:mod:`jascl.networks.clip_driven` for the head, its background row with logit 0 and its deviations).
What this method adds beyond that head:

* the paper's loss instead of the loop's softmax cross-entropy + Dice: binary cross-entropy and binary
  Dice on ``sigmoid`` of every foreground row, computed only on the rows of the classes the session labels
  (new and recurring): old classes that are not labelled again get no loss, as unlabelled classes of a
  partially labelled dataset in the paper (:func:`partial_label_losses`);
* growth by text embeddings: each new class's row is its text embedding (no prototype imprinting);
* on a backbone without the head (any backbone but ``clip-driven``), the method puts the head on the
  backbone's features itself, as a classifier replacing the pixel classifier for the method's sessions
  (the pixel classifier stays in the saved model, grown with zero rows so that the checkpoint loads; the
  head is saved with the session as the plugin's extra state).

Text embeddings: the ``clip-driven`` backbone's own (``backbone_args.embeddings``); otherwise
``method_args.clip-driven.embeddings`` (a file written by ``jascl text-embeddings``). With neither and
``encoding: auto`` the classes get one-hot codes -- the paper's own "one-hot" ablation of the text
embeddings -- with a warning; ``encoding: clip`` makes a missing file an error. A file that is given but
missing or lacks a class is a one-line error naming it.

Deviations, to fit our loop and benchmarks:

* the partial-label mask is per session (the union of the session's datasets' labelled classes), not
  per dataset within a batch;
* overlapping classes cannot both be predicted at a voxel (the head's arg-max, see the network module);
* the session's freezing policy applies as for every method (the run's ``freeze_incremental``: the
  paper's medical setting freezes the body and trains the head in incremental sessions);
* no pre-training on other datasets: pretrained weights of the body come from ``weights`` like for any
  backbone.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from jascl.engine.losses import binary_segmentation_losses
from jascl.engine.plugin import Method, Plugin
from jascl.errors import ConfigError
from jascl.methods.options import freeze_option, freeze_policy, option
from jascl.methods.registry import METHODS
from jascl.networks.clip_driven import ClipDrivenBackbone, TextDrivenClassifier, onehot_embeddings
from jascl.networks.text_embeddings import load_text_embeddings
from jascl.protocols.schema import IGNORE_INDEX

if TYPE_CHECKING:
    from jascl.engine.config import RunConfig
    from jascl.engine.state import LoopState

log = logging.getLogger("jascl")

#: smoothing of the binary Dice loss
DICE_SMOOTH = 1e-5


def partial_label_losses(
    logits: torch.Tensor, target: torch.Tensor, labelled_rows: list[int], smooth: float = DICE_SMOOTH
) -> tuple[torch.Tensor, torch.Tensor]:
    """The universal model's binary losses on the labelled rows only.

    Row ``k >= 1`` is a binary problem: positive where ``target == k``. Only the rows in
    ``labelled_rows`` contribute (the classes the session labels); pixels with ``IGNORE_INDEX`` never do.

    Args:
        logits: (B, K, *spatial); row 0 (background) is not used.
        target: (B, *spatial) classifier rows, ``IGNORE_INDEX`` = ignored.
        labelled_rows: rows (>= 1) with labels in this session.
        smooth: Dice smoothing.

    Returns:
        (bce, dice): :func:`jascl.engine.losses.binary_segmentation_losses` of the labelled rows, i.e. the
        mean over (sample, labelled row) pairs of the binary cross-entropy over the pair's valid pixels and of
        ``1 - (2 sum(p t) + s) / (sum(p) + sum(t) + s)``, as the official ``Multi_BCELoss`` / ``BinaryDiceLoss``
        (CLIP-CT's heads share them). Both are 0 when no row is labelled.
    """
    rows = [r for r in labelled_rows if r >= 1]
    if not rows:
        zero = logits.sum() * 0.0
        return zero, zero
    index = torch.tensor(rows, device=target.device).view(1, -1, *([1] * (target.dim() - 1)))
    positive = target.unsqueeze(1) == index  # (B, R, *spatial)
    valid = (target != IGNORE_INDEX).unsqueeze(1).expand_as(positive)
    return binary_segmentation_losses(logits[:, rows].float(), positive, valid, smooth)


@dataclass
class ClipDrivenOptions:
    """``method_args.clip-driven`` options (defaults: the official code).

    Attributes:
        embeddings: text embeddings file (``jascl text-embeddings``) for a backbone without its own
            (ignored with the ``clip-driven`` backbone, which has ``backbone_args.embeddings``).
        encoding: "auto" (the file if given, else one-hot codes with a warning), "clip" (the file is
            required) or "onehot" (the paper's ablation).
        hidden: width of the head's text and image projections (official: 256).
        head_channels: channels of the dynamic head (official: 8).
        freeze: incremental-session freezing (``config``: the run's).
    """

    embeddings: str = ""
    encoding: str = option("auto", choices=("auto", "clip", "onehot"))
    hidden: int = option(256, ge=1)
    head_channels: int = option(8, ge=1)
    freeze: str = freeze_option()


class ClipDrivenPlugin(Plugin):
    """The universal model's loss and text-embedding growth (module docstring); its own head where needed."""

    name = "clip-driven"
    replaces = ("classifier-growth", "supervised-loss")
    changes_base_session = True
    loss_terms = ("clip_bce", "clip_dice")
    base_loss_terms = ("clip_bce", "clip_dice")

    def __init__(self, options: ClipDrivenOptions) -> None:
        self.options = options
        self.freeze_incremental = freeze_policy(options.freeze)
        self.head: TextDrivenClassifier | None = None  # the method's own head (backbones without one)
        self.head_classes: list[int] = []  # global ids of the head's rows
        self._original: nn.Module | None = None
        self._labelled: list[int] = []

    # ------------------------------------------------------------- text embeddings

    def class_embeddings(self, state: LoopState, classes: list[int]) -> torch.Tensor:
        """(len(classes), D) embeddings of foreground ``classes`` (global ids): the file's, or one-hot codes."""
        o = self.options
        if o.encoding == "clip" and not o.embeddings:
            raise ConfigError(
                "method clip-driven: encoding=clip needs method_args.clip-driven.embeddings (a file written by "
                "`jascl text-embeddings --weights CLIP_FILE --protocol NAME --out FILE.safetensors`)"
            )
        if o.encoding != "onehot" and o.embeddings:
            names = {c.id: c.name for c in state.protocol.classes}
            return load_text_embeddings(o.embeddings, [names[c] for c in classes])
        everything = [c.id for c in state.protocol.classes if c.id != 0]
        return onehot_embeddings(everything, classes)

    def _native(self, state: LoopState) -> bool:
        return isinstance(state.model.classifier, TextDrivenClassifier) and self._original is None

    def _check_rows(self, state: LoopState) -> None:
        """The clip-driven backbone's row names must be the protocol's classes in row order."""
        backbone = state.model.backbone
        if not isinstance(backbone, ClipDrivenBackbone):
            return
        names = {c.id: c.name for c in state.protocol.classes}
        wanted = [names[c] for c in state.seen]
        have = backbone.rows[: len(wanted)]
        if have[1:] != wanted[1:]:
            raise ConfigError(
                f"backbone clip-driven: text embedding rows {have} do not match the protocol's classes {wanted}; "
                f"write the embeddings for protocol {state.protocol.name!r} with `jascl text-embeddings`"
            )

    # ------------------------------------------------------------- events

    def setup_model(self, state: LoopState) -> None:
        classifier = state.model.classifier
        new = len(state.seen) - classifier.num_classes
        if new <= 0:
            return
        if self._native(state):
            self._check_rows(state)
            classifier.grow(new)
        else:  # the pixel classifier is not used by this method; zero rows keep the saved model loadable
            classifier.grow(new, torch.zeros(new, classifier.in_channels))

    def before_session(self, state: LoopState) -> None:
        self._labelled = [state.seen.index(c) for c in state.session.classes]
        if self._native(state):
            return
        if self.options.encoding == "auto" and not self.options.embeddings and self.head is None:
            log.warning(
                "clip-driven: no method_args.clip-driven.embeddings file; the classes get one-hot codes (the "
                "paper's ablation), not CLIP text embeddings; write a file with `jascl text-embeddings`"
            )
        new = [c for c in state.seen[1:] if c not in self.head_classes]
        if new:
            embeddings = self.class_embeddings(state, new)
            with torch.random.fork_rng(devices=[]):  # seeded initialisation, the loop's random stream untouched
                torch.manual_seed(state.seed * 1000 + state.session.index)
                if self.head is None:
                    text = torch.cat([embeddings.new_zeros(1, embeddings.shape[1]), embeddings])
                    self.head = TextDrivenClassifier(
                        state.model.backbone.feature_channels,
                        text,
                        hidden=self.options.hidden,
                        head_channels=self.options.head_channels,
                    )
                else:
                    self.head.grow(len(new), embeddings=embeddings.to(self.head.weight))
            self.head_classes += new
        assert self.head is not None
        if [0, *self.head_classes] != list(state.seen):
            raise ValueError(f"clip-driven head rows {self.head_classes} do not follow the classifier's {state.seen}")
        self.head.to(state.device).requires_grad_(True)  # the loop collects the trainable parameters next
        self._original = state.model.classifier
        state.model.classifier = self.head

    def after_forward(self, state: LoopState) -> None:
        assert state.output is not None and state.target is not None  # set by the loop before after_forward
        bce, dice = partial_label_losses(state.output.logits, state.target, self._labelled)
        state.losses["clip_bce"] = state.config.lambda_ce * bce
        state.losses["clip_dice"] = state.config.lambda_dice * dice

    def after_session(self, state: LoopState) -> None:
        if self._original is not None:
            state.model.classifier = self._original
            self._original = None
        if self.head is not None:
            self.head.requires_grad_(False)

    # ------------------------------------------------------------- state across sessions

    def extra_state(self) -> dict[str, torch.Tensor]:
        if self.head is None:
            return {}
        out = {f"head.{k}": v.detach().cpu() for k, v in self.head.state_dict().items()}
        out["classes"] = torch.tensor(self.head_classes, dtype=torch.long)
        return out

    def load_extra_state(self, tensors: dict[str, torch.Tensor]) -> None:
        if "classes" not in tensors:
            return
        state = {k[len("head.") :]: v for k, v in tensors.items() if k.startswith("head.")}
        hidden, channels = state["global_proj.weight"].shape
        head_channels = state["feature_proj.weight"].shape[0]
        self.head = TextDrivenClassifier(channels, state["weight"], hidden=hidden, head_channels=head_channels)
        self.head.load_state_dict(state)
        self.head.requires_grad_(False)
        self.head_classes = [int(c) for c in tensors["classes"]]


@METHODS.register(
    "clip-driven",
    options=ClipDrivenOptions,
    paper="Liu et al., ICCV 2023",
    doc="baseline: CLIP-driven universal model (text-conditioned per-class heads, partial-label BCE+Dice), fine-tuned",
    fidelity=(
        "simplified: head on the decoder features, text rows trained; the universal model's pre-training only through "
        "--weights (its Swin UNETR body; the paper's U-Net release fits no jascl backbone)"
    ),
    flags=("pre-trained weights needed",),
)
def clip_driven(o: ClipDrivenOptions, config: RunConfig) -> Method:
    """CLIP-driven universal model fine-tuned over the sessions (see the module docstring)."""
    return Method("clip-driven", [ClipDrivenPlugin(o)], "CLIP-driven: text-conditioned heads, partial-label loss")
