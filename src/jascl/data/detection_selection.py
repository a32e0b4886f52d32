"""Which images of COCO-format entries each detection session uses (:mod:`jascl.data.detection_real`, steps 2-3):
a seed-free stratified test hold-out per entry, then a seeded selection of the training shots, the unlabelled pool
and the validation images per session, whole images, never one image in two splits of any session.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from jascl.data.detection_entries import CocoEntry
from jascl.data.real.selection import select_k_shot
from jascl.errors import DataError
from jascl.protocols.schema import DatasetSpec, Protocol, SessionSpec

__all__ = ["DetectionPlan", "draw_per_class", "hold_out_test", "plan_detection_sessions"]


def _stable_order(refs: Iterable[str]) -> list[str]:
    """An order that depends on the ids alone (no seed): by a hash of each id."""
    return sorted(refs, key=lambda r: (hashlib.sha1(r.encode()).hexdigest(), r))


def hold_out_test(order: Sequence[str], shows: Callable[[str], Iterable[int]], fraction: float) -> list[str]:
    """Test images, stratified: each class keeps ``round(fraction x n_c)`` images showing it (at most ``n_c - 1``).

    Args:
        order: candidate ids in the order to take them (a fixed, seed-free order).
        shows: id -> the classes the image shows.
        fraction: share of each class's images held out.

    Returns:
        The held-out ids, in ``order``. Classes are served rarest first (then by id); an image held for one
        class counts for every class it shows, and is passed over when holding it would leave a class it
        shows without a training image.
    """
    per_class: dict[int, list[str]] = {}
    for r in order:
        for c in shows(r):
            per_class.setdefault(c, []).append(r)
    held: set[str] = set()
    held_of = dict.fromkeys(per_class, 0)
    for c in sorted(per_class, key=lambda c: (len(per_class[c]), c)):
        want = min(int(np.floor(fraction * len(per_class[c]) + 0.5)), len(per_class[c]) - 1)
        for r in per_class[c]:
            if held_of[c] >= want:
                break
            if r in held or any(held_of[o] + 1 >= len(per_class[o]) for o in shows(r)):
                continue
            held.add(r)
            for o in shows(r):
                held_of[o] += 1
    return [r for r in order if r in held]


def draw_per_class(
    order: Sequence[str], shows: Callable[[str], Iterable[int]], counts: Mapping[int, int], taken: set[str]
) -> tuple[dict[int, list[str]], dict[int, int]]:
    """``counts[c]`` images showing class ``c`` per class, each drawn for one class; ``taken`` grows with them.

    Classes are served rarest first (fewest available images, then id); each takes the images of ``order`` that
    show it and are not yet taken. An image counts only for the class it was drawn for.

    Returns:
        (class -> ids drawn for it in drawing order, class -> shortfall (0 when complete)).
    """
    avail = {c: [r for r in order if c in shows(r) and r not in taken] for c in counts}
    drawn: dict[int, list[str]] = {}
    short: dict[int, int] = {}
    for c in sorted(counts, key=lambda c: (len(avail[c]), c)):
        got: list[str] = []
        for r in avail[c]:
            if len(got) >= counts[c]:
                break
            if r not in taken:
                taken.add(r)
                got.append(r)
        drawn[c] = got
        short[c] = counts[c] - len(got)
    return drawn, short


@dataclass
class DetectionPlan:
    """Sample ids of one session's splits (``unlabelled`` / ``validation``: None when the session asks for none)."""

    train: list[str]
    test: list[str]
    unlabelled: list[str] | None
    validation: list[str] | None


def _names(protocol: Protocol, classes: Iterable[int]) -> str:
    return ", ".join(protocol.class_name(c) for c in classes)


def _option_counts(protocol: Protocol, spec: DatasetSpec, classes: tuple[int, ...]) -> dict[int, int] | None:
    raw = spec.options.get("unlabelled")
    if not isinstance(raw, Mapping):
        return None
    out: dict[int, int] = {}
    for k, n in raw.items():
        cid = protocol.class_id(k) if isinstance(k, str) else int(k)
        if cid in classes:
            out[cid] = int(n)
    return out


def plan_detection_sessions(
    protocol: Protocol, entries: Mapping[str, CocoEntry], echo: Callable[[str], None] = print
) -> list[DetectionPlan]:
    """Seeded selection of every session's splits (module docstring, step 3).

    Raises:
        DataError: a class of a K-shot session is shown by fewer than K images left for training, or a session
            has no test image.
    """
    shows: dict[str, frozenset[int]] = {}
    test_pools: dict[str, set[str]] = {}
    for name, e in entries.items():
        taught = frozenset(
            c for s in protocol.sessions for src in s.sources if src.dataset == name for c in src.classes
        )
        for im in e.split.images:
            shows[e.ref(im.id)] = e.shows[im.id] & taught
        eligible = _stable_order(e.ref(i) for i in e.images_showing(taught))
        test_pools[name] = set(hold_out_test(eligible, shows.__getitem__, e.spec.test_fraction))
    used: set[str] = set()
    plans: list[DetectionPlan] = []
    for session in protocol.sessions:
        plans.append(_plan_session(protocol, session, entries, shows, test_pools, used, echo))
        p = plans[-1]
        used.update(p.train, p.unlabelled or (), p.validation or ())
    return plans


def _plan_session(
    protocol: Protocol,
    session: SessionSpec,
    entries: Mapping[str, CocoEntry],
    shows: Mapping[str, frozenset[int]],
    test_pools: Mapping[str, set[str]],
    used: set[str],
    echo: Callable[[str], None],
) -> DetectionPlan:
    where = f"{protocol.path}: session {session.index} ({session.name})"
    rng = np.random.default_rng([protocol.seed, session.index, 3571])
    taken = set(used)  # images of earlier sessions never serve again
    # per source: (entry, classes taught from it, its images in seeded order, minus the test pool)
    sources: list[tuple[CocoEntry, tuple[int, ...], list[str]]] = []
    test: list[str] = []
    missing_any: set[int] = set()  # classes without annotation: warned about once
    for src in session.sources:
        e = entries[src.dataset]
        missing = [c for c in src.classes if not e.images_showing([c])]
        missing_any.update(missing)
        if missing:
            message = (
                f"{where}: class(es) {_names(protocol, missing)} have no annotation in dataset {e.name} "
                f"({e.split.json_path})"
            )
            if session.shots is not None:
                raise DataError(f"{message}; a {session.shots}-shot session needs {session.shots} images of each")
            echo(f"warning: {message}; they are never trained")
        refs = sorted(e.ref(i) for i in e.images_showing(src.classes))
        test += [r for r in _stable_order(refs) if r in test_pools[e.name] and r not in used]
        order = [r for r in (refs[i] for i in rng.permutation(len(refs))) if r not in test_pools[e.name]]
        sources.append((e, src.classes, [r for r in order if r not in taken]))

    train: list[str] = []
    validation: list[str] | None = [] if session.validation else None
    if session.shots is None and session.validation:  # first: at most half of each class's images
        assert validation is not None
        for e, classes, order in sources:
            cands = {c: [r for r in order if c in shows[r]] for c in classes}
            cands = {c: v[: len(v) // 2] for c, v in cands.items()}
            in_session = frozenset(classes)

            def classes_of(r: str, cs: frozenset[int] = in_session) -> set[int]:
                return set(shows[r] & cs)

            chosen, got = select_k_shot(cands, classes_of, session.validation)
            validation += chosen
            taken.update(chosen)
            low = [c for c in classes if got[c] < session.validation and c not in missing_any]
            if low:
                echo(
                    f"warning: {where}: class(es) {_names(protocol, low)} get fewer than validation="
                    f"{session.validation} validation images in dataset {e.name} (at most half of a class's images)"
                )
    elif session.shots is not None:  # K images drawn for each class
        for e, classes, order in sources:
            drawn, short = draw_per_class(order, shows.__getitem__, dict.fromkeys(classes, session.shots), taken)
            for c in classes:
                if short[c]:
                    raise DataError(
                        f"{where}: class {protocol.class_name(c)} is shown by only {len(drawn[c])} training "
                        f"image(s) of dataset {e.name}, fewer than shots K={session.shots}; lower 'shots' or "
                        "test_fraction, or add data"
                    )
            train += [r for c in classes for r in drawn[c]]

    unlabelled: list[str] | None = [] if session.has_unlabelled_pool else None
    if unlabelled is not None:
        per_class = False
        for e, classes, order in sources:
            counts = _option_counts(protocol, e.spec, classes)
            if counts is None and session.unlabelled_per_class:
                counts = dict.fromkeys(classes, session.unlabelled_per_class)
            if counts is None:
                continue
            per_class = True
            pool, short = draw_per_class(order, shows.__getitem__, counts, taken)
            unlabelled += [r for c in classes if c in pool for r in pool[c]]
            for c in sorted(c for c in short if short[c] > 0):
                echo(
                    f"warning: {where}: dataset {e.name} has {len(pool[c])} image(s) of {protocol.class_name(c)} "
                    f"left for the unlabelled pool; the protocol asks for {counts[c]}"
                )
        if session.unlabelled and not per_class:  # a total size: images showing any session class
            rest = [r for _, _, order in sources for r in order if r not in taken]
            rest = [rest[i] for i in rng.permutation(len(rest))][: session.unlabelled]
            if len(rest) < session.unlabelled:
                echo(
                    f"warning: {where}: {len(rest)} image(s) left for the unlabelled pool; the protocol asks for "
                    f"{session.unlabelled}"
                )
            unlabelled += rest
            taken.update(rest)

    if session.shots is None:
        for _, _, order in sources:
            train += [r for r in order if r not in taken]
        train = train[: session.train] if session.train is not None else train
    elif session.validation:  # last, so the shots and the pool are those of validation: 0
        assert validation is not None
        for e, classes, order in sources:
            val, short = draw_per_class(order, shows.__getitem__, dict.fromkeys(classes, session.validation), taken)
            validation += [r for c in classes for r in val[c]]
            low = [c for c in classes if short[c]]
            if low:
                echo(
                    f"warning: {where}: class(es) {_names(protocol, low)} get fewer than validation="
                    f"{session.validation} validation images in dataset {e.name}"
                )
    if session.test is not None:
        test = test[: session.test]
    if not test:
        raise DataError(
            f"{where}: no test image shows its classes {_names(protocol, session.classes)}; raise test_fraction or "
            "add data"
        )
    if not train:
        raise DataError(f"{where}: no training image shows its classes {_names(protocol, session.classes)}")
    return DetectionPlan(train, test, unlabelled, validation)
