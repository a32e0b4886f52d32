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

Two options give the authors' training path (the ``authors`` configuration preset):

* ``values="authors"``: the plugin replays its own prototypes instead of the store's eq. 2 ones,
  computed like the authors' ``get_prototype`` (:mod:`jascl.engine.prototypes`, ``form="authors"``):
  per sample the mean of unit pixel features, averaged without renormalising; in session 0 over
  ``base_samples`` randomly chosen samples per class (their 10), later over every labelled sample
  (the K shots). Class and complement come from the same samples.
* ``noise_draws="per-prototype"``: one classifier call per prototype, so a GAS-perturbed classifier
  draws its noise once per prototype, as the authors' loop over prototypes does (``"shared"``: one
  batched call, one draw for all of a step's prototypes).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from jascl.engine.plugin import Plugin
from jascl.engine.prototypes import PrototypeRequest

if TYPE_CHECKING:
    from jascl.engine.state import LoopState

BACKGROUNDS = ("per-class", "session")
VALUES = ("eq2", "authors")
NOISE_DRAWS = ("shared", "per-prototype")


def prototype_replay_loss(
    classifier: torch.nn.Module,
    prototypes: torch.Tensor,
    targets: torch.Tensor,
    reduction: str = "sum",
    unit: bool = False,
    per_prototype: bool = False,
) -> torch.Tensor:
    """Cross-entropy of the classifier applied to stored prototypes.

    Args:
        classifier: maps (N, D) vectors to (N, K) logits.
        prototypes: (N, D) stored prototypes.
        targets: (N,) classifier row index of each prototype's class (0 = background).
        reduction: "sum" over prototypes (the authors' code) or "mean".
        unit: ``prototypes`` are already L2-normalised rows, for a cosine
            :class:`~jascl.networks.classifier.PixelClassifier` (which then skips normalising them).
        per_prototype: call the classifier once per prototype (a stochastic classifier, e.g. under GAS,
            then draws its weights once per prototype) instead of once for all.
    """

    def logits_of(x: torch.Tensor) -> torch.Tensor:
        return classifier(x, unit=True) if unit else classifier(x)

    if per_prototype:
        logits = torch.cat([logits_of(prototypes[i : i + 1]) for i in range(len(prototypes))])
    else:
        logits = logits_of(prototypes)
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
        values: "eq2" (the prototype store's) or "authors" (the plugin's own, computed as the authors do).
        base_samples: with ``values="authors"``, session-0 prototypes average at most this many randomly
            chosen samples per class (0 = all).
        noise_draws: "shared" (one classifier call per step) or "per-prototype" (one per prototype).
    """

    name = "proto"
    loss_terms = ("proto",)

    def __init__(
        self,
        weight: float = 0.1,
        reduction: str = "sum",
        background: str = "per-class",
        values: str = "eq2",
        base_samples: int = 0,
        noise_draws: str = "shared",
    ) -> None:
        for key, value, choices in (
            ("background", background, BACKGROUNDS),
            ("values", values, VALUES),
            ("noise_draws", noise_draws, NOISE_DRAWS),
        ):
            if value not in choices:
                raise ValueError(f"prototype replay: {key}={value!r}, expected one of {', '.join(choices)}")
        self.weight = weight
        self.reduction = reduction
        self.background = background
        self.values = values
        self.base_samples = base_samples
        self.noise_draws = noise_draws
        self.complements: dict[tuple[int, int], torch.Tensor] = {}
        #: values="authors": the plugin's own class prototypes, (session, class) -> (D,)
        self.own: dict[tuple[int, int], torch.Tensor] = {}
        self._protos: torch.Tensor | None = None
        self._targets: torch.Tensor | None = None
        self._unit = False

    # -------------------------------------------------- the prototypes this plugin computes itself

    def _wanted(self, state: LoopState) -> list[int]:
        """The session's classes whose prototypes this plugin has not computed yet (``values="authors"``: class
        prototypes, with background under ``background="session"``; else the ``per-class`` complements)."""
        t = state.session.index
        if self.values == "authors":
            classes = [0, *state.session.classes] if self.background == "session" else list(state.session.classes)
            return [c for c in classes if (t, c) not in self.own]
        if self.background != "per-class":
            return []
        return [c for c in state.session.classes if (t, c) not in self.complements]

    def prototype_requests(self, state: LoopState) -> list[PrototypeRequest]:
        """What :meth:`_add_own` will ask for in ``before_eval`` (served with the store's in one pass)."""
        wanted = tuple(self._wanted(state))
        if not wanted:
            return []
        if self.values != "authors":
            return [PrototypeRequest(wanted, complement=True)]
        requests = [PrototypeRequest(wanted, per_sample=True, form="authors")]
        if self.background == "per-class":
            requests.append(PrototypeRequest(wanted, per_sample=True, complement=True, form="authors"))
        return requests

    def restore_requests(self, state: LoopState) -> list[PrototypeRequest]:
        """What :meth:`session_restored` will ask of a shared base it did not train (the same calls)."""
        return self.prototype_requests(state)

    def _add_own(self, state: LoopState) -> None:
        """After session t's training (or when it is reused): the complements (``per-class``) and, with
        ``values="authors"``, the class prototypes, of the session's classes not computed yet; the calls of
        :meth:`prototype_requests`, in one pass (in ``before_eval``, the loop's)."""
        t = state.session.index
        requests = self.prototype_requests(state)
        if not requests:
            return
        results = state.compute_prototype_requests(requests)
        if self.values == "authors":
            self._add_authors(state, results[0], results[1] if len(results) > 1 else {})
            return
        for c, vector in results[0].items():
            self.complements[(t, int(c))] = vector.detach().float().cpu()

    def _add_authors(self, state: LoopState, samples: dict, complements: dict) -> None:
        """The plugin's own class prototypes (and complements) from the per-sample ones, base samples drawn."""
        t = state.session.index
        for c, vectors in samples.items():
            chosen = base_sample_indices(len(vectors), self.base_samples if t == 0 else 0, state.seed, t, int(c))
            self.own[(t, int(c))] = vectors[chosen].mean(0).detach().float().cpu()
            if c in complements:  # the same samples, in the same order (form="authors" counts a sample for both)
                self.complements[(t, int(c))] = complements[c][chosen].mean(0).detach().float().cpu()

    def before_eval(self, state: LoopState) -> None:
        self._add_own(state)

    def session_restored(self, state: LoopState) -> None:
        self._add_own(state)

    def extra_state(self) -> dict[str, torch.Tensor]:
        out = {f"bg.s{s}.c{c}": v.contiguous() for (s, c), v in self.complements.items()}
        out.update({f"own.s{s}.c{c}": v.contiguous() for (s, c), v in self.own.items()})
        return out

    def load_extra_state(self, tensors: dict[str, torch.Tensor]) -> None:
        for key, value in tensors.items():
            kind, _, rest = key.partition(".")
            if kind not in ("bg", "own"):
                continue
            s, c = rest.split(".")
            target = self.complements if kind == "bg" else self.own
            target[(int(s[1:]), int(c[1:]))] = value.float()

    # -------------------------------------------------- training

    def before_session(self, state: LoopState) -> None:
        self._protos = None
        if state.session.index == 0:
            return
        t = state.session.index
        if self.values == "authors":
            store = {k: v for k, v in self.own.items() if k[0] < t}
        else:
            store = state.prototypes.before(t).entries
        complements = {k: v for k, v in self.complements.items() if k[0] < t}
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
                state.model.classifier,
                self._protos,
                self._targets,
                self.reduction,
                unit=self._unit,
                per_prototype=self.noise_draws == "per-prototype",
            )
            state.losses[self.name] = self.weight * loss


def base_sample_indices(n: int, k: int, seed: int, session: int, class_id: int) -> torch.Tensor:
    """Which of a class's ``n`` per-sample prototypes to average: all when ``k`` is 0 or >= ``n``, else ``k``
    drawn without replacement from a generator seeded by (seed, session, class), in increasing order."""
    if k <= 0 or k >= n:
        return torch.arange(n)
    generator = torch.Generator().manual_seed(int(seed) * 1_000_003 + session * 1009 + class_id)
    return torch.randperm(n, generator=generator)[:k].sort().values
