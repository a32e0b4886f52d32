"""MTL: multi-task training of the shared representation over the sessions seen so far.

Source: Wang, Zhao, Li, "Bridging Multi-Task Learning and Meta-Learning: Towards
Efficient Training and Effective Adaptation", ICML 2021 (arXiv 2106.09017).
The paper trains a shared representation phi with one linear head w_t per
training task on the average of the task losses,
``min_{phi, w_1..w_T} (1/T) sum_t L_t(w_t, phi)``, shows that this multi-task
objective matches gradient-based meta-learning (MAML-type bilevel training)
at a fraction of its cost, and at test time fine-tunes on the new task's
support data.

What it does here (incremental sessions only; session 0 is vanilla's shared base,
which is this objective with one task):

* Tasks are sessions. Task s is the segmentation of background plus the
  classes labelled in session s; its head is the rows of the shared
  classifier for those classes (:func:`task_row_mask`): the task's logits are
  the full logits with every other row masked out. A class taught again in a
  later session belongs to both tasks (its row is shared).
* The current task's loss ``L_t`` is the run's DiceCE on the labelled batch,
  restricted to the session's head (:func:`task_target` maps the targets to
  the head's columns).
* The earlier tasks' data: jascl keeps no images, so the stored class
  prototypes of every earlier session (``state.prototypes``: eq. 2 mean
  features of background and each class, one per (session, class)) stand for
  them. Each earlier task's loss ``L_s`` is the cross-entropy of its
  prototypes through the classifier, restricted to task s's head
  (:func:`prototype_task_losses`).
* The objective is the paper's uniform task average (:func:`combine_task_losses`):
  ``losses["mtl_current"] = L_t / T`` and ``losses["mtl_previous"] =
  sum_{s<t} L_s / T`` with T = t + 1 tasks. The session's own training is
  the paper's test-time fine-tuning on the new task's support data.

What jascl's setting forbids, and what was done instead:

* The paper trains phi on every task's *images*; an exemplar-free continual
  setting has none of the earlier sessions. The prototypes are fixed feature
  vectors, so the earlier tasks' losses train their heads (the classifier)
  only, not the representation; the representation is trained by the current
  task alone. With the run's default ``freeze_incremental =
  all_but_classifier`` the representation is frozen anyway and the stored
  prototypes are exactly the current model's features of those classes; with
  ``freeze: none`` they grow stale as the backbone moves (not corrected).
* Prediction uses all seen classes' rows together (the continual protocol
  scores every seen class), not one head per task chosen by a task id.

Other deviations: no separate head parameters (the shared classifier's rows
are the heads, so checkpoints keep the standard layout); the optimiser and
learning rate are the run's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from jascl.engine.defaults import default_supervised_loss
from jascl.engine.losses import SegmentationLoss
from jascl.engine.plugin import Method, Plugin
from jascl.methods.options import check_options, freeze_option, freeze_policy, option
from jascl.methods.registry import METHODS
from jascl.protocols.schema import IGNORE_INDEX

if TYPE_CHECKING:
    from jascl.engine.config import RunConfig
    from jascl.engine.state import LoopState


def task_row_mask(task_rows: list[list[int]], num_rows: int) -> torch.Tensor:
    """Which classifier rows form each task's head.

    Args:
        task_rows: per task, its classifier rows (background's row 0 included).
        num_rows: K, rows of the classifier.

    Returns:
        (T, K) bool mask.
    """
    mask = torch.zeros(len(task_rows), num_rows, dtype=torch.bool)
    for t, rows in enumerate(task_rows):
        mask[t, rows] = True
    return mask


def task_target(target: torch.Tensor, rows: list[int], num_rows: int) -> torch.Tensor:
    """Targets as columns of a task head: row ``rows[j]`` becomes ``j``; other rows and 255 become 255.

    Args:
        target: (B, *spatial) classifier rows or 255.
        rows: the head's classifier rows, in column order.
        num_rows: K, rows of the classifier.

    Returns:
        (B, *spatial) long, head columns or 255.
    """
    lut = torch.full((max(num_rows, IGNORE_INDEX + 1),), IGNORE_INDEX, dtype=torch.long, device=target.device)
    lut[torch.tensor(rows, dtype=torch.long, device=target.device)] = torch.arange(len(rows), device=target.device)
    return lut[target.long()]


def prototype_task_losses(
    logits: torch.Tensor, rows: torch.Tensor, tasks: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Per-task cross-entropy of stored prototypes through their task's head.

    Args:
        logits: (N, K) classifier logits of N prototypes.
        rows: (N,) classifier row of each prototype's class (the target).
        tasks: (N,) task index of each prototype, in [0, T).
        mask: (T, K) bool, the rows of each task's head (:func:`task_row_mask`).

    Returns:
        (T,) mean cross-entropy over each task's prototypes (0 for a task without any),
        the softmax taken over that task's rows only.
    """
    masked = logits.float().masked_fill(~mask[tasks], float("-inf"))
    ce = F.cross_entropy(masked, rows, reduction="none")
    num_tasks = mask.shape[0]
    total = ce.new_zeros(num_tasks).index_add(0, tasks, ce)
    count = ce.new_zeros(num_tasks).index_add(0, tasks, torch.ones_like(ce))
    return total / count.clamp_min(1.0)


def combine_task_losses(current: torch.Tensor, previous: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The multi-task objective (1/T) sum_t L_t, split into the current task's and the earlier tasks' share.

    Args:
        current: 0-dim loss of the current task.
        previous: (T - 1,) losses of the earlier tasks (may be empty).

    Returns:
        (current / T, sum(previous) / T) with T = len(previous) + 1.
    """
    num_tasks = previous.numel() + 1
    return current / num_tasks, previous.sum() / num_tasks


@dataclass
class MTLOptions:
    """``method_args.mtl`` options.

    Attributes:
        prototype_tasks: let the stored prototypes of earlier sessions stand for their tasks
            (False: the current task alone, i.e. plain fine-tuning of its head).
        freeze: incremental-session freezing (``config``: the run's ``freeze_incremental``).
    """

    prototype_tasks: bool = option(True, doc="earlier sessions' stored prototypes stand for their tasks' data")
    freeze: str = freeze_option()


class MTLPlugin(Plugin):
    """Task-average of the current session's segmentation loss and earlier sessions' prototype losses."""

    name = "mtl"
    replaces = ("supervised-loss",)  # the current task's loss is restricted to its head
    snapshot_exclude = ("_loss",)

    def __init__(self, options: MTLOptions | None = None) -> None:
        o = self.options = options or MTLOptions()
        check_options(o, "method_args.mtl")
        self.freeze_incremental = freeze_policy(o.freeze)
        self.loss_terms = ("mtl_current", "mtl_previous") if o.prototype_tasks else ("mtl_current",)
        self._loss: SegmentationLoss | None = None
        #: the current task's head rows, and the earlier tasks' prototypes (N, C), rows (N,), tasks (N,), mask (T-1, K)
        self.current_rows: list[int] = []
        self.protos = torch.zeros(0, 0)
        self.proto_rows = torch.zeros(0, dtype=torch.long)
        self.proto_tasks = torch.zeros(0, dtype=torch.long)
        self.task_mask = torch.zeros(0, 0, dtype=torch.bool)

    def before_session(self, state: LoopState) -> None:
        self._loss = SegmentationLoss.for_session(state.config, state.session.index, state.model.num_classes)
        t = state.session.index
        row_of = {c: r for r, c in enumerate(state.seen)}
        self.current_rows = [row_of[c] for c in (0, *state.session.classes)]
        vectors, rows, tasks, heads = [], [], [], []
        if t > 0 and self.options.prototype_tasks:
            entries = state.prototypes.before(t).entries
            for s in range(t):
                classes = (0, *state.protocol.sessions[s].classes)
                heads.append([row_of[c] for c in classes])
                for c in classes:
                    if (s, c) in entries:
                        vectors.append(entries[(s, c)])
                        rows.append(row_of[c])
                        tasks.append(s)
        k = len(state.seen)
        self.task_mask = task_row_mask(heads, k).to(state.device)
        if vectors:
            self.protos = torch.stack(vectors).to(state.device)
            self.proto_rows = torch.tensor(rows, device=state.device)
            self.proto_tasks = torch.tensor(tasks, device=state.device)
        else:
            self.protos = torch.zeros(0, state.model.backbone.feature_channels, device=state.device)
            self.proto_rows = torch.zeros(0, dtype=torch.long, device=state.device)
            self.proto_tasks = torch.zeros(0, dtype=torch.long, device=state.device)

    def after_forward(self, state: LoopState) -> None:
        if state.session.index == 0:
            state.losses["seg"] = default_supervised_loss(state)
            return
        assert state.output is not None and state.target is not None and self._loss is not None
        k = state.model.num_classes
        rows = self.current_rows
        logits = state.output.logits[:, rows]
        # the dataset maps classes not taught in the session to background or 255, so no target
        # pixel falls outside the head and the batch's has_ignore still holds
        current = self._loss(logits, task_target(state.target, rows, k), state.has_ignore)
        previous = current.new_zeros(self.task_mask.shape[0])  # an earlier task without prototypes adds 0
        if self.protos.shape[0]:
            proto_logits = state.model.classifier(self.protos)
            previous = prototype_task_losses(proto_logits, self.proto_rows, self.proto_tasks, self.task_mask)
        mine, earlier = combine_task_losses(current, previous)
        state.losses["mtl_current"] = mine
        if self.options.prototype_tasks:
            state.losses["mtl_previous"] = earlier


@METHODS.register(
    "mtl",
    options=MTLOptions,
    paper="Wang et al., ICML 2021",
    doc="baseline: multi-task objective over sessions (heads = classifier rows; earlier tasks via prototypes)",
    fidelity="simplified: earlier tasks enter as stored prototypes through their heads, not images",
)
def mtl(options: MTLOptions, config: RunConfig) -> Method:
    return Method("mtl", [MTLPlugin(options)], "MTL: task-average loss over the sessions seen so far")
