"""BCM: base-class mining -- each novel class's update constrained through the base classes relevant to it.

**Which paper.** The JASCL paper cites BCM as ``sakai2024a`` and describes it as "mine relevant base
classes" (few-shot class-incremental learning). The search tools available here found no paper by
Sakai et al. (2024) on base-class mining for FSCIL: no abstract, full text or code could be read.
What follows is therefore a **reconstruction from JASCL's one-line description**, not an
implementation checked against the original; treat its numbers as those of "a base-class-mining
regulariser", and replace the losses if the paper becomes available.

**What it does here** (incremental sessions only; session 0 is vanilla's, so the base is shared):

* *Mining* (start of every incremental session, :func:`mine_relevant_base_classes`): for every class
  new in the session, its eq. 2 prototype from the session's labelled data under the session-start
  model is compared by cosine similarity with the stored session-0 prototypes of the base
  foreground classes; the ``top_k`` most similar base classes are its relevant base classes, with
  relevance weights ``softmax(similarity / temperature)`` over those k.
* *Constraint* (every step), through the relevant base classes only:

  - ``bcm_logit`` (:func:`relevant_logit_constraint`): on the pixels labelled with a novel class, the
    student's logits of that class's relevant base classes are held at the previous model's, squared
    error weighted by relevance -- learning the novel class must not rewrite how its look-alike base
    classes respond to it, which is where the few-shot update damages the base classes most;
  - ``bcm_anchor`` (:func:`relevant_anchor_loss`): the classifier rows of the relevant base classes
    are anchored at their session-start values, weighted by the summed relevance over novel classes.

* ``state.report["bcm_relevance"]``: for each novel class id, its ``[base class id, weight]`` pairs.

**Adaptations to segmentation**: prototypes are eq. 2 pixel prototypes (the loop's store) instead of
image embeddings; the logit constraint acts per pixel on the pixels of the novel class; background is
not a candidate (it is a catch-all, not a base class a novel class resembles).

**Deviations / unknowns**: the losses, ``top_k`` (3), the relevance temperature (0.1) and the weights
(1, 1) are ours, since the paper could not be read; no other part of a published BCM recipe (e.g. a
base-session training change) is implemented, so the base model is shared with vanilla, as JASCL's
table (session 0 = 0.700) indicates it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from jascl.engine.plugin import Method
from jascl.methods.baselines.distillation._shared import TeacherPlugin
from jascl.methods.options import freeze_option, freeze_policy, option
from jascl.methods.registry import METHODS

if TYPE_CHECKING:
    from jascl.engine.config import RunConfig
    from jascl.engine.state import LoopState


def mine_relevant_base_classes(
    novel_prototypes: torch.Tensor, base_prototypes: torch.Tensor, top_k: int, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """For each novel prototype, the ``top_k`` most cosine-similar base prototypes and their relevance weights.

    Args:
        novel_prototypes: (N, D).
        base_prototypes: (B, D), B >= 1.
        top_k: relevant base classes per novel class (clipped to B).
        temperature: softmax temperature over the k similarities.

    Returns:
        index (N, k) int64 positions in ``base_prototypes``, most similar first (ties: lower index first);
        weight (N, k), each row ``softmax(similarity / temperature)`` over its k entries (sums to 1).
    """
    sim = F.normalize(novel_prototypes.float(), dim=1) @ F.normalize(base_prototypes.float(), dim=1).t()
    k = min(top_k, base_prototypes.shape[0])
    order = torch.sort(sim, dim=1, descending=True, stable=True).indices[:, :k]
    weight = torch.softmax(sim.gather(1, order) / temperature, dim=1)
    return order, weight


def relevant_logit_constraint(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    target: torch.Tensor,
    novel_rows: list[int],
    relevant_rows: torch.Tensor,
    weight: torch.Tensor,
) -> torch.Tensor:
    """Relevance-weighted squared change of the relevant base logits on the novel classes' pixels.

    ``mean over pixels p labelled novel_rows[n] of sum_j weight[n, j] (s_{r_nj}(p) - t_{r_nj}(p))^2``
    with r_nj = ``relevant_rows[n, j]``; all novel classes' pixels are pooled in one mean.

    Args:
        student_logits: (B, K, *spatial).
        teacher_logits: (B, K_old, *spatial), K_old > every relevant row.
        target: (B, *spatial) classifier rows, 255 = ignore.
        novel_rows: N rows of the session's novel classes.
        relevant_rows: (N, k) rows of their relevant base classes.
        weight: (N, k) relevance weights.

    Returns:
        Scalar; 0 (attached to the student's graph) when no pixel shows a novel class.
    """
    total = student_logits.sum() * 0.0
    count = 0
    for n, row in enumerate(novel_rows):
        mask = target == row  # (B, *spatial)
        pixels = int(mask.sum())
        if pixels == 0:
            continue
        rows = relevant_rows[n].tolist()
        diff = (student_logits[:, rows] - teacher_logits[:, rows].detach()).pow(2)  # (B, k, *spatial)
        w = weight[n].to(diff).view(1, -1, *([1] * (diff.dim() - 2)))
        total = total + ((diff * w).sum(dim=1) * mask).sum()
        count += pixels
    return total / max(count, 1)


def relevant_anchor_loss(
    rows: torch.Tensor, anchors: torch.Tensor, relevant_rows: torch.Tensor, weight: torch.Tensor
) -> torch.Tensor:
    """``sum_n sum_j weight[n, j] ||W[r_nj] - W*[r_nj]||^2``: relevance-weighted anchoring of classifier rows.

    Args:
        rows: (K, C) current classifier weight.
        anchors: (K_old, C) the rows at the start of the session.
        relevant_rows: (N, k) rows of the relevant base classes of each novel class.
        weight: (N, k) relevance weights.
    """
    flat = relevant_rows.flatten()
    sq = (rows[flat] - anchors[flat].detach()).pow(2).sum(dim=1)
    return (sq * weight.flatten().to(sq)).sum()


@dataclass
class BCMOptions:
    """``method_args.bcm`` options (the paper could not be read: every default is ours, see the module docstring).

    Attributes:
        top_k: relevant base classes mined per novel class.
        temperature: softmax temperature of the relevance weights over the k cosine similarities.
        weight_logit: weight of the relevant-logit constraint on novel pixels.
        weight_anchor: weight of the relevance-weighted anchoring of the relevant base rows.
        freeze: "config" (default), "none" or "all_but_classifier".
    """

    top_k: int = option(3, ge=1)
    temperature: float = option(0.1, gt=0)
    weight_logit: float = option(1.0, ge=0)
    weight_anchor: float = option(1.0, ge=0)
    freeze: str = freeze_option()


class BCMPlugin(TeacherPlugin):
    """Mines each novel class's relevant base classes and constrains the update through them."""

    name = "bcm"

    def __init__(self, options: BCMOptions | None = None) -> None:
        self.options = o = options or BCMOptions()
        super().__init__(freeze_policy(o.freeze))
        self.loss_terms = tuple(n for n, w in (("bcm_logit", o.weight_logit), ("bcm_anchor", o.weight_anchor)) if w)
        self.novel_rows: torch.Tensor | None = None  # (N,)
        self.relevant_rows: torch.Tensor | None = None  # (N, k)
        self.relevance: torch.Tensor | None = None  # (N, k)

    def before_session(self, state: LoopState) -> None:
        super().before_session(state)
        self.novel_rows = self.relevant_rows = self.relevance = None
        if self.teacher is None:
            return
        base_ids = sorted(c for (s, c) in state.prototypes.entries if s == 0 and c != 0)
        novel_ids = [c for c in state.session.new_classes if c != 0]
        if not base_ids or not novel_ids:
            return
        novel = state.compute_prototypes(novel_ids)
        novel_ids = [c for c in novel_ids if c in novel]  # a class with no labelled pixel has no prototype
        if not novel_ids:
            return
        base = torch.stack([state.prototypes.entries[(0, c)] for c in base_ids])
        index, weight = mine_relevant_base_classes(
            torch.stack([novel[c].cpu() for c in novel_ids]), base, self.options.top_k, self.options.temperature
        )
        self.novel_rows = torch.tensor([state.seen.index(c) for c in novel_ids])
        self.relevant_rows = torch.tensor([[state.seen.index(base_ids[int(i)]) for i in r] for r in index])
        self.relevance = weight
        state.report["bcm_relevance"] = {
            str(c): [[base_ids[int(i)], float(w)] for i, w in zip(index[n], weight[n])] for n, c in enumerate(novel_ids)
        }

    def after_forward(self, state: LoopState) -> None:
        if self.teacher is None or self.relevant_rows is None:
            return
        o = self.options
        if o.weight_logit:
            teacher = self.teacher_outputs(state).logits[:, : self.num_old]
            state.losses["bcm_logit"] = o.weight_logit * relevant_logit_constraint(
                state.output.logits, teacher, state.target, self.novel_rows.tolist(), self.relevant_rows, self.relevance
            )
        if o.weight_anchor:
            state.losses["bcm_anchor"] = o.weight_anchor * relevant_anchor_loss(
                state.model.classifier.weight,
                self.teacher.classifier.weight,
                self.relevant_rows.to(state.device),
                self.relevance,
            )

    def after_session(self, state: LoopState) -> None:
        super().after_session(state)
        self.novel_rows = self.relevant_rows = self.relevance = None


@METHODS.register(
    "bcm",
    options=BCMOptions,
    paper="Sakai et al., 2024 (not located; reconstructed from JASCL's description)",
    doc="baseline: relevant base classes mined per novel class, update constrained through them",
)
def bcm(options: BCMOptions, config: RunConfig) -> Method:
    """BCM: prototype-similarity mining of relevant base classes; logit and anchor constraints through them."""
    return Method("bcm", [BCMPlugin(options)], "BCM: constraints through the mined relevant base classes")
