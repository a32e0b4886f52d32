"""Seeded K-shot selection: the labelled, validation, test and unlabelled samples of every session (a plan), with
at least K labelled samples containing each class taught, and samples an earlier session used taken last.

Validation samples (``SessionSpec.validation`` V > 0) are labelled samples of the training pool, at least V
containing each taught class (:func:`select_k_shot`), never among the session's training, test or unlabelled
samples: in a K-shot session they are taken after the K shots and the unlabelled pool (which stay those of
V = 0); in a session with ``shots: all`` they are taken first, at most half of the samples showing its classes,
and training gets the rest (else an uncapped base session would leave none).

Unlabelled samples borrowed from other datasets (``unlabelled_sources``, :class:`~jascl.protocols.schema.UnlabelledSourceSpec`)
are drawn after every session's plan (:func:`borrow_unlabelled`), so they change no other split: from the named
dataset's training pool and label-free records, never a test, validation or labelled training sample of any session.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from jascl.data.real.sources import DatasetSource
from jascl.errors import DataError
from jascl.protocols.schema import Protocol


def select_k_shot(
    candidates: Mapping[int, Sequence[str]], classes_of: Callable[[str], set[int]], k: int
) -> tuple[list[str], dict[int, int]]:
    """Fewest samples such that each class is contained in at least ``k`` of them, greedily.

    Classes are served rarest first (fewest candidates, then lowest id); each takes
    its candidates in the given (seeded) order until ``k`` selected samples contain
    it, counting samples already chosen for other classes.

    Args:
        candidates: class -> ids of samples containing it, in preference order.
        classes_of: sample id -> the classes (keys of ``candidates``) it contains.
        k: shots per class.

    Returns:
        (selected ids in selection order, class -> number of selected samples containing it).
    """
    counts = {c: 0 for c in candidates}
    selected: list[str] = []
    chosen: set[str] = set()
    for c in sorted(candidates, key=lambda c: (len(candidates[c]), c)):
        for rid in candidates[c]:
            if counts[c] >= k:
                break
            if rid in chosen:
                continue
            chosen.add(rid)
            selected.append(rid)
            for other in classes_of(rid):
                if other in counts:
                    counts[other] += 1
    return selected, counts


@dataclass
class SessionPlan:
    """Sample ids (``<dataset>/<record id>``) of one session's splits (``validation``: None when none is asked)."""

    session: int
    name: str
    train: list[str]
    test: list[str]
    unlabelled: list[str] | None
    shortfalls: list[str] = field(default_factory=list)
    validation: list[str] | None = None


def _ref(dataset: str, rid: str) -> str:
    return f"{dataset}/{rid}"


def split_ref(ref: str) -> tuple[str, str]:
    dataset, sep, rid = ref.partition("/")
    if not sep or not rid:
        raise ValueError(ref)
    return dataset, rid


def plan_sessions(
    protocol: Protocol,
    sources: Mapping[str, DatasetSource],
    problems: list[str] | None = None,
    echo: Callable[[str], None] = print,
) -> list[SessionPlan]:
    """Seeded K-shot / test / unlabelled selection of every session (see the module docstring).

    Args:
        sources: opened and indexed dataset entries by name.
        problems: if given, impossible requests are appended as one-line messages
            (and the session keeps what is possible) instead of raising DataError.
    """

    def fail(message: str) -> None:
        if problems is None:
            raise DataError(message)
        problems.append(message)

    used_train: dict[str, set[str]] = {n: set() for n in sources}
    used_test: dict[str, set[str]] = {n: set() for n in sources}
    plans: list[SessionPlan] = []
    for session in protocol.sessions:
        t = session.index
        where = f"{protocol.path}: session {t} ({session.name})"
        missing = sorted({s.dataset for s in session.sources} - set(sources))
        if missing:  # only in a dry run (jascl data check) after a dataset failed to open
            if problems is None:
                raise DataError(f"{where}: dataset(s) {', '.join(missing)} are not open")
            plans.append(SessionPlan(t, session.name, [], [], None))
            continue
        rng = np.random.default_rng([protocol.seed, t, 7717])
        srcs = [(s, sources[s.dataset]) for s in session.sources]

        def ordered(refs: list[str], used: Mapping[str, set[str]]) -> list[str]:
            """Seeded order, samples not yet used by an earlier session first."""
            refs = sorted(set(refs))
            perm = [refs[i] for i in rng.permutation(len(refs))]
            return sorted(perm, key=lambda r: split_ref(r)[1] in used[split_ref(r)[0]])

        # per class: (dataset -> native ids) over the sources that teach it
        class_natives: dict[int, dict[str, set[int]]] = {c: {} for c in session.classes}
        for spec, src in srcs:
            for c, natives in src.natives_of(spec.classes).items():
                class_natives[c][src.name] = natives

        def contains_class(ref: str, c: int) -> bool:
            d, rid = split_ref(ref)
            natives = class_natives[c].get(d)
            return natives is not None and bool(natives) and sources[d].contains(rid, natives)

        def classes_in(ref: str) -> set[int]:
            return {c for c in session.classes if contains_class(ref, c)}

        shortfalls: list[str] = []

        def draw_validation(order: list[str], taken: set[str], limit: int | None = None) -> list[str]:
            """At least ``session.validation`` samples of ``order`` (minus ``taken``) containing each class, at most
            ``limit`` in all (the rarest classes' first)."""
            cands = {c: [r for r in order if r not in taken and contains_class(r, c)] for c in session.classes}
            chosen, _ = select_k_shot(cands, classes_in, session.validation)
            chosen = chosen[:limit]
            counts = {c: sum(contains_class(r, c) for r in chosen) for c in session.classes}
            for c in session.classes:
                if counts[c] < session.validation:
                    shortfalls.append(
                        f"class {c} ({protocol.class_name(c)}) is in only {counts[c]} validation sample(s), fewer "
                        f"than validation={session.validation} (the training pool has no more to spare); lower "
                        "'validation' or add data"
                    )
            return chosen

        # --- labelled training samples (and validation samples)
        pool = [_ref(src.name, r) for _, src in srcs for r in src.train_pool if r not in src.excluded]
        pool_order = ordered(pool, used_train)
        validation: list[str] | None = None
        if session.shots is None:
            eligible = [r for r in pool_order if any(contains_class(r, c) for c in session.classes)]
            held: set[str] = set()
            if session.validation:  # first, at most half the eligible samples (a small copy keeps training data)
                validation = draw_validation(pool_order, set(), limit=len(eligible) // 2)
                held = set(validation)
            train = [r for r in eligible if r not in held]
            if session.train is not None:
                train = train[: session.train]
            if not train:
                fail(
                    f"{where}: no training sample contains any of its classes "
                    f"{_names(protocol, session.classes)}; check the datasets' label maps and roots"
                )
        else:
            candidates = {c: [r for r in pool_order if contains_class(r, c)] for c in session.classes}
            train, counts = select_k_shot(candidates, classes_in, session.shots)
            for c in session.classes:
                if counts[c] < session.shots:
                    fail(
                        f"{where}: class {c} ({protocol.class_name(c)}) is in only {len(candidates[c])} training "
                        f"sample(s) of {', '.join(class_natives[c]) or 'its datasets'}, fewer than shots K="
                        f"{session.shots}; lower 'shots' or add data"
                    )
        # --- test samples
        test_pool = [
            _ref(src.name, r)
            for spec, src in srcs
            for r in src.test_pool
            if r not in src.excluded and src.contains(r, set().union(*src.natives_of(spec.classes).values()))
        ]
        test = ordered(test_pool, used_test)
        if session.test is not None:
            test = test[: session.test]
        if not test:
            fail(
                f"{where}: no test sample contains any of its classes {_names(protocol, session.classes)}; "
                "add test data or change the datasets' test_splits / test_fraction"
            )
        # --- unlabelled pool
        unlabelled: list[str] | None = None
        if session.unlabelled or session.unlabelled_per_class:
            taken = set(train) | set(validation or ())
            rest = [r for r in pool if r not in taken]
            rest += [_ref(src.name, r) for _, src in srcs for r in src.label_free if r not in src.excluded]
            rest_order = ordered(rest, used_train)
            unlabelled = []
            if session.unlabelled_per_class:
                cands = {c: [r for r in rest_order if contains_class(r, c)] for c in session.classes}
                unlabelled, counts = select_k_shot(cands, classes_in, session.unlabelled_per_class)
                for c in session.classes:
                    if counts[c] < session.unlabelled_per_class:
                        shortfalls.append(
                            f"class {c} ({protocol.class_name(c)}): {counts[c]} unlabelled of "
                            f"{session.unlabelled_per_class} requested"
                        )
            if session.unlabelled:
                chosen = set(unlabelled)
                extra = [r for r in rest_order if r not in chosen][: session.unlabelled]
                if len(extra) < session.unlabelled:
                    shortfalls.append(f"{len(extra)} unlabelled of {session.unlabelled} requested")
                unlabelled += extra
            if not unlabelled:
                fail(
                    f"{where}: the protocol asks for an unlabelled pool but none of "
                    f"{', '.join(src.name for _, src in srcs)} has samples left beyond the labelled shots; "
                    "add unlabelled data (e.g. imagesTs/) or set unlabelled: 0"
                )
        if session.validation and session.shots is not None:  # after the shots and the pool, which stay those of V = 0
            validation = draw_validation(pool_order, set(train) | set(unlabelled or ()))
        for s in shortfalls:
            echo(f"[data] warning: session {t} ({session.name}): {s}")
        for ref in train + (validation or []) + (unlabelled or []):
            d, rid = split_ref(ref)
            used_train[d].add(rid)
        for ref in test:
            d, rid = split_ref(ref)
            used_test[d].add(rid)
        plans.append(
            SessionPlan(
                t,
                session.name,
                sorted(train),
                sorted(test),
                sorted(unlabelled) if unlabelled is not None else None,
                shortfalls,
                sorted(validation) if validation is not None else None,
            )
        )
    borrow_unlabelled(protocol, sources, plans, fail)
    return plans


def borrow_unlabelled(
    protocol: Protocol, sources: Mapping[str, DatasetSource], plans: Sequence[SessionPlan], fail: Callable[[str], None]
) -> None:
    """Add every session's ``unlabelled_sources`` samples to its plan's unlabelled pool (in place).

    Eligible samples of dataset ``D``: its training pool and label-free records, without the records
    ``jascl data check`` excluded and without every session's labelled training, validation and test
    samples (the strict reading: labelled samples of earlier sessions are not borrowed either). The
    order is seeded by (seed, session, ``D``), samples in no session's unlabelled pool first; the
    first ``count`` are taken. Fewer eligible than ``count`` is reported through ``fail`` as one line
    naming the protocol file, the key and how many are available (the plan keeps what there is).
    """
    labelled: set[str] = set()
    pooled: set[str] = set()
    for plan in plans:
        labelled.update(plan.train, plan.test, plan.validation or ())
        pooled.update(plan.unlabelled or ())
    for session, plan in zip(protocol.sessions, plans):
        if not session.unlabelled_extra:
            continue
        borrowed: list[str] = []
        for j, spec in enumerate(session.unlabelled_sources):
            name = str(spec.dataset)
            src = sources.get(name)
            if src is None or not spec.count:  # not open: only in a dry run after the dataset failed to open
                continue
            refs = [_ref(name, r) for r in sorted(set(src.train_pool) | set(src.label_free)) if r not in src.excluded]
            eligible = [r for r in refs if r not in labelled]
            rng = np.random.default_rng([protocol.seed, session.index, 9931, zlib.crc32(name.encode())])
            order = sorted((eligible[i] for i in rng.permutation(len(eligible))), key=lambda r: r in pooled)
            if len(order) < spec.count:
                fail(
                    f"{protocol.path}: sessions[{session.index}].unlabelled_sources[{j}].count: {spec.count} "
                    f"samples asked from dataset {name!r}, only {len(order)} available (its training pool and "
                    "label-free records less every session's labelled, validation and test samples); lower the "
                    f"count to at most {len(order)}"
                )
            borrowed += order[: spec.count]
        plan.unlabelled = sorted([*(plan.unlabelled or []), *borrowed])


def _names(protocol: Protocol, classes: Iterable[int]) -> str:
    return "[" + ", ".join(f"{c}:{protocol.class_name(c)}" for c in classes) + "]"


def session_summary(protocol: Protocol, plans: Sequence[SessionPlan]) -> list[dict]:
    """Per session: classes and labelled / unlabelled / validation / test counts (for ``jascl data check``)."""
    rows = []
    for s, p in zip(protocol.sessions, plans):
        rows.append(
            {
                "session": s.index,
                "name": s.name,
                "domains": list(s.domains),
                "classes": [f"{c}:{protocol.class_name(c)}" for c in s.classes],
                "shots": "all" if s.shots is None else s.shots,
                "labelled": len(p.train),
                "unlabelled": len(p.unlabelled) if p.unlabelled is not None else 0,
                "validation": len(p.validation) if p.validation is not None else 0,
                "test": len(p.test),
            }
        )
    return rows
