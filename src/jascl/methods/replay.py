"""Prototype replay (L_proto): stored prototypes of earlier sessions trained through the classifier.

The paper says only that "prototypes are replayed at the classifier F"; which background
prototypes are replayed is the authors' code's choice, so the paper's numbers used it:

* ``background="per-class"`` (default, the authors' ``save_protos``): every class c of a
  session brings two entries, its prototype P_c (target c) and the prototype of its
  complement, the pixels of c's samples that are not c (target 0). L_proto sums 2N terms,
  half of them background.
* ``background="session"``: the prototype store's entries as they are, one background
  prototype per session from its label-0 pixels plus one per class (N + S terms); jascl's
  default before 2026-11-27. On a 15-class base session background is 1 of 16 terms
  instead of 15 of 30.

The complements are computed after each session's training from its labelled samples with
the same model as the store's prototypes (:func:`jascl.engine.prototypes.per_sample_prototypes`
with ``complement=True``), saved with the session checkpoint, and computed again when a session
is reused from a folder that lacks them (a base shared with another method).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from jascl.engine.plugin import Plugin

if TYPE_CHECKING:
    from jascl.engine.state import LoopState

BACKGROUNDS = ("per-class", "session")


def prototype_replay_loss(
    classifier: torch.nn.Module,
    prototypes: torch.Tensor,
    targets: torch.Tensor,
    reduction: str = "sum",
    unit: bool = False,
) -> torch.Tensor:
    """Cross-entropy of the classifier applied to stored prototypes.

    Args:
        classifier: maps (N, D) vectors to (N, K) logits.
        prototypes: (N, D) stored prototypes.
        targets: (N,) classifier row index of each prototype's class (0 = background).
        reduction: "sum" over prototypes (the authors' code) or "mean".
        unit: ``prototypes`` are already L2-normalised rows, for a cosine
            :class:`~jascl.networks.classifier.PixelClassifier` (which then skips normalising them).
    """
    logits = classifier(prototypes, unit=True) if unit else classifier(prototypes)
    return F.cross_entropy(logits, targets, reduction=reduction)


def replay_set(
    store: dict[tuple[int, int], torch.Tensor], complements: dict[tuple[int, int], torch.Tensor], background: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The prototypes L_proto replays and their global class ids (0 = background).

    Args:
        store: (session, class id) -> (D,) prototypes of earlier sessions (class 0 = a session's background).
        complements: (session, class id) -> (D,) prototype of that class's complement (``per-class`` only).
        background: "per-class" (each class followed by its complement, target 0; the store's
            session backgrounds are not used) or "session" (the store as it is).

    Returns:
        (N, D) prototypes and (N,) class ids, in (session, class) order; empty (0, 0) and (0,) when none.
    """
    if background not in BACKGROUNDS:
        raise ValueError(f"prototype replay: background={background!r}, expected one of {', '.join(BACKGROUNDS)}")
    vectors: list[torch.Tensor] = []
    ids: list[int] = []
    for key in sorted(store):
        c = key[1]
        if background == "session":
            vectors.append(store[key])
            ids.append(c)
        elif c != 0:
            vectors.append(store[key])
            ids.append(c)
            if key in complements:
                vectors.append(complements[key])
                ids.append(0)
    if not vectors:
        return torch.zeros(0, 0), torch.zeros(0, dtype=torch.long)
    return torch.stack(vectors), torch.tensor(ids)


class PrototypeReplayPlugin(Plugin):
    """Adds ``weight * L_proto`` in incremental sessions, replaying every earlier session's prototypes.

    Args:
        weight: loss weight (paper / authors, medical: 0.1).
        reduction: "sum" (authors) or "mean" over prototypes.
        background: which background prototypes are replayed: "per-class" (authors, default) or
            "session" (see the module docstring).
    """

    name = "proto"
    loss_terms = ("proto",)

    def __init__(self, weight: float = 0.1, reduction: str = "sum", background: str = "per-class") -> None:
        if background not in BACKGROUNDS:
            raise ValueError(f"prototype replay: background={background!r}, expected one of {', '.join(BACKGROUNDS)}")
        self.weight = weight
        self.reduction = reduction
        self.background = background
        self.complements: dict[tuple[int, int], torch.Tensor] = {}
        self._protos: torch.Tensor | None = None
        self._targets: torch.Tensor | None = None
        self._unit = False

    # -------------------------------------------------- the complements (per-class backgrounds)

    def _add_complements(self, state: LoopState) -> None:
        t = state.session.index
        wanted = [c for c in state.session.classes if (t, c) not in self.complements]
        if self.background != "per-class" or not wanted:
            return
        for c, vector in state.compute_prototypes(wanted, complement=True).items():
            self.complements[(t, int(c))] = vector.detach().float().cpu()

    def before_eval(self, state: LoopState) -> None:
        self._add_complements(state)

    def session_restored(self, state: LoopState) -> None:
        self._add_complements(state)

    def extra_state(self) -> dict[str, torch.Tensor]:
        return {f"bg.s{s}.c{c}": v.contiguous() for (s, c), v in self.complements.items()}

    def load_extra_state(self, tensors: dict[str, torch.Tensor]) -> None:
        for key, value in tensors.items():
            if key.startswith("bg."):
                s, c = key[3:].split(".")
                self.complements[(int(s[1:]), int(c[1:]))] = value.float()

    # -------------------------------------------------- training

    def before_session(self, state: LoopState) -> None:
        self._protos = None
        if state.session.index == 0:
            return
        store = state.prototypes.before(state.session.index).entries
        complements = {k: v for k, v in self.complements.items() if k[0] < state.session.index}
        protos, class_ids = replay_set(store, complements, self.background)
        if len(class_ids):
            from jascl.networks.classifier import PixelClassifier

            self._protos = protos.to(state.device)
            classifier = state.model.classifier
            # a cosine classifier would normalise the same constant rows at every step: do it once here
            self._unit = isinstance(classifier, PixelClassifier) and classifier.cosine
            if self._unit:
                self._protos = F.normalize(self._protos, dim=1)
            self._targets = state.class_index(class_ids).to(state.device)

    def after_forward(self, state: LoopState) -> None:
        if self._protos is not None and self._targets is not None and self.weight > 0:
            loss = prototype_replay_loss(
                state.model.classifier, self._protos, self._targets, self.reduction, unit=self._unit
            )
            state.losses[self.name] = self.weight * loss
