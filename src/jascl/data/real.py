"""Sessions of a protocol on public datasets: roots, label maps, K-shot selection, lazy splits.

A protocol's ``datasets`` section names local dataset copies by their on-disk
layout (:mod:`jascl.data.layouts`); its sessions list which dataset teaches which
classes (:class:`~jascl.protocols.schema.SourceSpec`). This module turns that into
one :class:`~jascl.data.synthetic.SessionData` per session, in four steps:

1. **Roots** (:func:`resolve_roots`): each dataset entry names its root folder;
   the path comes from ``--root NAME=PATH``, a roots file (YAML ``NAME: PATH``) or
   the environment variable ``JASCL_ROOT_<NAME>`` -- never from code or protocols.
2. **Pools** (:class:`DatasetSource`): the layout's records split into a training
   pool (``train_splits``), a test pool (``test_splits``, or a hold-out fraction of
   the training pool, grouped e.g. by video and independent of the run seed so every
   seed is scored on the same test samples) and label-less records (usable only as
   unlabelled data). Which native labels each labelled sample contains is read once
   and cached (``<cache>/real/labels-*.json``, keyed by file sizes and times).
3. **Selection** (:func:`plan_sessions`): seeded (the protocol's seed, 1024 by
   default as the authors used) K-shot selection that guarantees at least K
   labelled samples containing each class the session teaches
   (:func:`select_k_shot`), test samples containing the session's classes, and
   unlabelled pools (``unlabelled`` in total and/or ``unlabelled_per_class``) from
   the remaining training samples and label-less records. Samples already used by
   an earlier session are taken last, so sessions drawing on one dataset get
   disjoint samples where the dataset allows. The plan is the K-shot *manifest*
   (sample ids ``<dataset entry>/<record id>``); a saved manifest can replace the
   selection (``--split-manifest``), so two runs see exactly the same few shots.
4. **Lazy splits** (:class:`LazySamples`): samples are decoded, preprocessed
   (``jascl.data.medical.preprocess_volume`` / ``jascl.data.natural.preprocess_image``)
   and cached on disk on first access, never all held in memory.

Ground truth in global ids (every split of session ``t``, sample from dataset ``D``):
a native label mapped to class ``c`` becomes ``c`` if ``c`` was taught *from D* in a
session ``<= t``, else 255 (ignore: the class exists there but is not measured in
this domain yet); native labels the dataset declares but the protocol does not map
become background or ignore (``unmapped``), except a label the dataset names
"background", which stays background; values the dataset does not declare, and
native 255 (every layout's "ignore") unless mapped, become 255. So every class is measured in the domain(s) where it was taught, and a
class that recurs in a new domain is measured there from its recurrence on.

Interface of lazy splits for the evaluator and trainer (``split.images`` /
``split.labels`` are :class:`LazySamples`): ``len()``, ``[i]`` -> one array
(image ``(C, *spatial)`` float32, label ``(*spatial)`` uint8 global ids),
``[a:b]`` -> an ``(n, ...)`` stacked array when the samples share a shape, else a
*list* of arrays (evaluate those one at a time), ``.ndim`` (2 + spatial dims for
images, 1 + for labels), ``.shape`` ((N, C, *spatial) with ``None`` for sizes that
vary or are not known before decoding) and ``.uniform`` (True when every sample is
known to have the same shape).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from jascl.data.cache import cached
from jascl.data.synthetic import default_cache_dir
from jascl.data.types import SessionData, Split
from jascl.errors import ConfigError, DataError
from jascl.protocols.schema import IGNORE_INDEX, DatasetSpec, Protocol

log = logging.getLogger("jascl")

#: bump when the cached preprocessed samples change meaning
PREPROCESS_VERSION = 1
MANIFEST_FORMAT = 2


# ------------------------------------------------------------------------------------------------ roots


def env_var(root_name: str) -> str:
    """``JASCL_ROOT_<NAME>``: the root name upper-cased, other characters as '_' (``bdd-10k`` -> ``JASCL_ROOT_BDD_10K``)."""
    return "JASCL_ROOT_" + re.sub(r"[^A-Z0-9]", "_", root_name.upper())


def parse_root_args(items: Sequence[str] | None) -> dict[str, str]:
    """``["amos=/data/AMOS", ...]`` (from ``--root``) -> ``{"amos": "/data/AMOS"}``.

    Raises:
        ConfigError: an item without ``=`` or with an empty name or path.
    """
    out: dict[str, str] = {}
    for item in items or []:
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ConfigError(f"--root {item}: expected NAME=PATH, e.g. --root amos=/data/AMOS22")
        out[name.strip()] = path.strip()
    return out


def read_roots_file(path: str | Path) -> dict[str, str]:
    """A YAML mapping ``NAME: PATH`` (``--roots FILE``)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{p}: roots file not found (a YAML mapping of dataset root names to folders)")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(data, Mapping) or not all(isinstance(v, (str, Path)) for v in data.values()):
        raise ConfigError(f"{p}: must be a mapping of root names to folders, e.g. 'amos: /data/AMOS22'")
    return {str(k): str(v) for k, v in data.items()}


def root_names(protocol: Protocol) -> dict[str, list[str]]:
    """Root name -> the dataset entries (and layouts) that use it."""
    out: dict[str, list[str]] = {}
    for spec in protocol.datasets.values():
        out.setdefault(spec.root, []).append(f"{spec.name} ({spec.layout})")
    return out


def resolve_roots(
    protocol: Protocol,
    given: Mapping[str, str | Path] | None = None,
    roots_file: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
    problems: list[str] | None = None,
) -> dict[str, Path]:
    """Folder of every root name the protocol uses: ``given`` (``--root``) > roots file > environment.

    Args:
        problems: if given, unset roots are appended here as one-line messages
            instead of raising.

    Raises:
        DataError: a root is not set anywhere (one line naming the flag and variable to set).
        ConfigError: ``given`` names a root the protocol does not use (a typo).
    """
    environ = os.environ if environ is None else environ
    names = root_names(protocol)
    given = dict(given or {})
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise ConfigError(
            f"--root {unknown[0]}=...: protocol {protocol.name} has no dataset root of that name "
            f"(its roots: {', '.join(sorted(names)) or 'none'})"
        )
    from_file = read_roots_file(roots_file) if roots_file is not None else {}
    out: dict[str, Path] = {}
    for name, users in sorted(names.items()):
        path = given.get(name) or from_file.get(name) or environ.get(env_var(name))
        if path:
            out[name] = Path(path).expanduser()
            continue
        message = (
            f"dataset root {name!r} ({', '.join(users)}) is not set; pass --root {name}=PATH or set {env_var(name)}"
        )
        if problems is None:
            raise DataError(f"{protocol.path}: {message}")
        problems.append(message)
    return out


# ------------------------------------------------------------------------------------------------ sources


def _signature(paths: Iterable[Path]) -> str:
    """Digest of the files' paths, sizes and modification times (folders: every file inside)."""
    parts: list[str] = []
    for path in paths:
        path = Path(path)
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for f in files:
            try:
                st = f.stat()
                parts.append(f"{f}|{st.st_size}|{st.st_mtime_ns}")
            except OSError:
                parts.append(f"{f}|missing")
    return hashlib.sha1("\n".join(parts).encode()).hexdigest()[:16]


def _normalise_name(name: str) -> str:
    return re.sub(r"[\s_\-/]+", " ", name.strip().lower())


@dataclass
class DatasetSource:
    """One dataset entry of a protocol, opened on its local copy.

    Attributes:
        spec: the protocol's entry.
        layout: the layout instance reading the copy.
        records: every record the layout found, by record id.
        train_pool / test_pool: labelled record ids of the training and test pools.
        label_free: ids of records without a label file (unlabelled data only).
        native: resolved native id -> global id (255 = ignore).
        known: native ids the layout declares (None when it declares none).
        presence: record id -> native ids present in its label (filled by :meth:`index`).
        excluded: record ids left out (``jascl data check`` found problems with them).
    """

    spec: DatasetSpec
    layout: Any
    records: dict[str, Any]
    train_pool: list[str]
    test_pool: list[str]
    label_free: list[str]
    native: dict[int, int]
    known: set[int] | None
    presence: dict[str, frozenset[int]] = field(default_factory=dict)
    excluded: set[str] = field(default_factory=set)

    @property
    def name(self) -> str:
        return self.spec.name

    def natives_of(self, classes: Iterable[int]) -> dict[int, set[int]]:
        """Global class -> the native ids mapped to it."""
        wanted = set(classes)
        out: dict[int, set[int]] = {c: set() for c in wanted}
        for native, g in self.native.items():
            if g in wanted:
                out[g].add(native)
        return out

    def contains(self, record_id: str, natives: set[int]) -> bool:
        return bool(self.presence.get(record_id, frozenset()) & natives)

    def index(
        self,
        cache_dir: Path,
        record_ids: Iterable[str] | None = None,
        echo: Callable[[str], None] = print,
        problems: list[str] | None = None,
    ) -> None:
        """Read which native labels every labelled record contains (cached on disk).

        Args:
            record_ids: records to index (default: both pools).
            problems: if given, unreadable labels are appended here (and the record is
                excluded) instead of raising.
        """
        ids = [
            r
            for r in (record_ids if record_ids is not None else self.train_pool + self.test_pool)
            if r not in self.excluded
        ]
        key = hashlib.sha1(
            f"{self.spec.layout}|{Path(self.layout.root).resolve()}|"
            f"{json.dumps(dict(self.spec.options), sort_keys=True, default=str)}".encode()
        ).hexdigest()[:12]
        path = cache_dir / "real" / f"labels-{self.spec.layout}-{key}.json"
        try:
            stored = json.loads(path.read_text()) if path.is_file() else {}
        except (OSError, json.JSONDecodeError):
            stored = {}
        todo = []
        for rid in ids:
            rec = self.records[rid]
            sig = _signature(rec.files)
            entry = stored.get(rid)
            if entry and entry.get("sig") == sig:
                self.presence[rid] = frozenset(entry["labels"])
            else:
                todo.append((rid, sig))
        if todo:
            echo(f"[data] {self.name}: reading {len(todo)} label file(s) to index their classes (cached afterwards)")
        for n, (rid, sig) in enumerate(todo):
            try:
                label = read_native_label(self.layout, self.records[rid])
            except DataError as exc:
                if problems is None:
                    raise
                problems.append(str(exc))
                self.excluded.add(rid)
                continue
            values = _present_values(label)
            self.presence[rid] = frozenset(values)
            stored[rid] = {"sig": sig, "labels": sorted(values)}
            if (n + 1) % 200 == 0:
                _atomic_json(path, stored)
        if todo:
            _atomic_json(path, stored)


def read_native_label(layout: Any, record: Any) -> np.ndarray:
    """The native label array of a record, decoding as little as the layout allows."""
    if hasattr(layout, "read_label"):
        return np.asarray(layout.read_label(record))
    if hasattr(layout, "decode_label") and record.label is not None and not Path(record.label).is_dir():
        return np.asarray(layout.decode_label(Path(record.label))[0])
    sample = layout.read(record)
    if sample.label is None:
        raise DataError(f"{record.label or record.id}: the layout read no label for this sample")
    return np.asarray(sample.label)


def _present_values(label: np.ndarray) -> list[int]:
    flat = np.asarray(label).reshape(-1)
    if flat.size == 0:
        return []
    if flat.dtype.kind in "iub" and flat.min() >= 0 and flat.max() < 1 << 20:
        counts = np.bincount(flat.astype(np.int64, copy=False))
        return [int(v) for v in np.nonzero(counts)[0]]
    return sorted(int(v) for v in np.unique(flat))


def _atomic_json(path: Path, payload: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(payload))
    os.replace(tmp, path)


def _layouts():
    from jascl.data.layouts import LAYOUTS

    return LAYOUTS


def open_source(
    protocol: Protocol, spec: DatasetSpec, root: Path, problems: list[str] | None = None
) -> DatasetSource | None:
    """Open dataset entry ``spec`` on ``root``: scan it, build its pools, resolve its label map.

    Returns None (with the problem appended) when ``problems`` is given and the
    dataset cannot be opened at all.
    """

    def fail(message: str) -> None:
        if problems is None:
            raise DataError(message)
        problems.append(message)

    layouts = _layouts()
    if spec.layout not in layouts:
        raise ConfigError(
            f"{protocol.path}: datasets.{spec.name}.layout: unknown layout {spec.layout!r}; "
            f"choose one of {', '.join(layouts.list())}"
        )
    try:
        layout = layouts.create(spec.layout, root=root, **dict(spec.options))
        records = {r.id: r for r in layout.scan()}
    except DataError as exc:
        fail(f"dataset {spec.name}: {exc}")
        return None
    try:
        names = {int(k): str(v) for k, v in (layout.label_names() or {}).items()}
    except NotImplementedError:
        names = {}
    native = _resolve_label_map(protocol, spec, names, root, fail)
    if native is None:
        return None
    # 255 is every layout's "ignore" (values a 2D layout cannot decode are read as 255), and a
    # label the dataset names "background" is background whatever the unmapped policy
    native.setdefault(IGNORE_INDEX, IGNORE_INDEX)
    for i, n in names.items():
        if _normalise_name(n) == "background":
            native.setdefault(i, 0)
    known = (set(names) | set(native)) if names else None

    labelled = [r for r in records.values() if r.label is not None]
    label_free = sorted(r.id for r in records.values() if r.label is None)
    train_pool = sorted(r.id for r in labelled if r.split in spec.train_splits)
    if spec.test_splits:
        test_pool = sorted(r.id for r in labelled if r.split in spec.test_splits)
    else:
        train_pool, test_pool = _hold_out(spec, [records[i] for i in train_pool])
    for what, pool, splits in (
        ("training", train_pool, spec.train_splits),
        ("test", test_pool, spec.test_splits or spec.train_splits),
    ):
        if not pool:
            found = sorted({r.split for r in labelled}) or ["none with labels"]
            fail(
                f"dataset {spec.name} ({root}): no labelled samples for the {what} pool (splits {list(splits)}; "
                f"labelled splits found: {', '.join(found)}); set datasets.{spec.name}."
                f"{'train_splits' if what == 'training' else 'test_splits / test_fraction'} to fit the copy"
            )
    return DatasetSource(spec, layout, records, train_pool, test_pool, label_free, native, known)


def _resolve_label_map(
    protocol: Protocol, spec: DatasetSpec, names: Mapping[int, str], root: Path, fail: Callable[[str], None]
) -> dict[int, int] | None:
    """Native keys given as names -> ids via the layout's label names; ids are checked against them."""
    by_name: dict[str, list[int]] = {}
    for i, n in names.items():
        by_name.setdefault(_normalise_name(n), []).append(i)
    out: dict[int, int] = {}
    ok = True
    for key, gid in spec.labels.items():
        where = f"{protocol.path}: datasets.{spec.name}.labels.{key}"
        if isinstance(key, str):
            ids = by_name.get(_normalise_name(key), [])
            if len(ids) != 1:
                reason = "is ambiguous" if ids else "is not"
                fail(
                    f"{where}: {key!r} {reason} a label name of the {spec.layout} dataset at {root} "
                    f"(its labels: {', '.join(f'{i}={n}' for i, n in sorted(names.items())) or 'none declared'}); "
                    "use a native id or one of those names"
                )
                ok = False
                continue
            out[ids[0]] = gid
        else:
            if names and key not in names and key != IGNORE_INDEX:
                fail(
                    f"{where}: native label {key} is not a label of the {spec.layout} dataset at {root} "
                    f"(its labels: {', '.join(map(str, sorted(names)))}); fix the protocol's label map "
                    "or use the dataset release it was written for"
                )
                ok = False
                continue
            out[int(key)] = gid
    return out if ok else None


def _hold_out(spec: DatasetSpec, records: Sequence[Any]) -> tuple[list[str], list[str]]:
    """Seeded hold-out of ``test_fraction`` of the groups (``group_by`` meta key, else samples).

    The seed derives from the dataset entry's name only, so every run seed is scored on
    the same test samples.
    """
    groups: dict[str, list[str]] = {}
    for r in records:
        g = str(r.meta.get(spec.group_by, r.id)) if spec.group_by else r.id
        groups.setdefault(g, []).append(r.id)
    keys = sorted(groups)
    if len(keys) < 2:
        return sorted(r.id for r in records), []
    rng = np.random.default_rng([zlib.crc32(spec.name.encode()), 1024])
    order = [keys[i] for i in rng.permutation(len(keys))]
    n_test = min(len(keys) - 1, max(1, int(round(spec.test_fraction * len(keys)))))
    test = sorted(i for g in order[:n_test] for i in groups[g])
    train = sorted(i for g in order[n_test:] for i in groups[g])
    return train, test


# ------------------------------------------------------------------------------------------------ selection


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
    """Sample ids (``<dataset>/<record id>``) of one session's splits."""

    session: int
    name: str
    train: list[str]
    test: list[str]
    unlabelled: list[str] | None
    shortfalls: list[str] = field(default_factory=list)


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
            return bool(natives) and sources[d].contains(rid, natives)

        # --- labelled training samples
        pool = [_ref(src.name, r) for _, src in srcs for r in src.train_pool if r not in src.excluded]
        pool_order = ordered(pool, used_train)
        if session.shots is None:
            train = [r for r in pool_order if any(contains_class(r, c) for c in session.classes)]
            if session.train is not None:
                train = train[: session.train]
            if not train:
                fail(
                    f"{where}: no training sample contains any of its classes "
                    f"{_names(protocol, session.classes)}; check the datasets' label maps and roots"
                )
        else:
            candidates = {c: [r for r in pool_order if contains_class(r, c)] for c in session.classes}
            train, counts = select_k_shot(
                candidates, lambda r: {c for c in session.classes if contains_class(r, c)}, session.shots
            )
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
        shortfalls: list[str] = []
        if session.unlabelled or session.unlabelled_per_class:
            taken = set(train)
            rest = [r for r in pool if r not in taken]
            rest += [_ref(src.name, r) for _, src in srcs for r in src.label_free if r not in src.excluded]
            rest_order = ordered(rest, used_train)
            unlabelled = []
            if session.unlabelled_per_class:
                cands = {c: [r for r in rest_order if contains_class(r, c)] for c in session.classes}
                unlabelled, counts = select_k_shot(
                    cands, lambda r: {c for c in session.classes if contains_class(r, c)}, session.unlabelled_per_class
                )
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
            for s in shortfalls:
                echo(f"[data] warning: session {t} ({session.name}): {s}")
        for ref in train + (unlabelled or []):
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
            )
        )
    return plans


def _names(protocol: Protocol, classes: Iterable[int]) -> str:
    return "[" + ", ".join(f"{c}:{protocol.class_name(c)}" for c in classes) + "]"


# ------------------------------------------------------------------------------------------------ manifests


def manifest_dict(protocol: Protocol, data: Sequence[SessionData], roots: Mapping[str, Path] | None = None) -> dict:
    """The K-shot manifest of a run: sample ids of every split, per session (written as ``manifest.json``)."""
    manifest: dict[str, Any] = {
        "format": MANIFEST_FORMAT,
        "protocol": protocol.name,
        "seed": protocol.seed,
        "sessions": [],
    }
    if protocol.uses_datasets:
        manifest["datasets"] = {
            n: {"layout": s.layout, "root": s.root, "path": str(roots[s.root]) if roots and s.root in roots else None}
            for n, s in protocol.datasets.items()
        }
    for s, d in zip(protocol.sessions, data):
        entry: dict[str, Any] = {
            "session": s.index,
            "name": s.name,
            "shots": s.shots if s.shots is not None else "all",
            "train": list(d.train.ids),
            "test": list(d.test.ids),
        }
        if s.sources:
            entry["sources"] = [{"dataset": src.dataset, "classes": list(src.classes)} for src in s.sources]
        if d.unlabelled is not None:
            entry["unlabelled"] = list(d.unlabelled.ids)
        manifest["sessions"].append(entry)
    return manifest


def load_manifest(path: str | Path, protocol: Protocol) -> dict:
    """Read a manifest and check that it belongs to ``protocol`` (name, sessions, shots).

    Raises:
        DataError: unreadable, or made for another protocol (one line naming the file and the difference).
    """
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{p}: split manifest not found; give the manifest.json of an earlier run folder")
    try:
        m = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"{p}: not a valid manifest ({exc}); give the manifest.json of an earlier run folder") from None
    if not isinstance(m, dict) or not isinstance(m.get("sessions"), list):
        raise DataError(f"{p}: not a manifest (no 'sessions' list); give the manifest.json of an earlier run folder")
    fix = "use a manifest written by a run of this protocol"
    if m.get("protocol") != protocol.name:
        raise DataError(f"{p}: made for protocol {m.get('protocol')!r}, not {protocol.name!r}; {fix}")
    sessions = m["sessions"]
    if len(sessions) != len(protocol.sessions):
        raise DataError(
            f"{p}: has {len(sessions)} sessions, protocol {protocol.name} has {len(protocol.sessions)}; {fix}"
        )
    for s, entry in zip(protocol.sessions, sessions):
        if not isinstance(entry, dict) or not all(isinstance(entry.get(k), list) for k in ("train", "test")):
            raise DataError(f"{p}: sessions[{s.index}] lacks 'train' / 'test' id lists; {fix}")
        if entry.get("name") != s.name:
            raise DataError(f"{p}: sessions[{s.index}] is {entry.get('name')!r}, the protocol's is {s.name!r}; {fix}")
        shots = s.shots if s.shots is not None else "all"
        if entry.get("shots") != shots:
            raise DataError(
                f"{p}: sessions[{s.index}] ({s.name}) was selected with shots={entry.get('shots')}, "
                f"the protocol asks for shots={shots}; {fix}"
            )
        if (entry.get("unlabelled") is not None) != bool(s.unlabelled or s.unlabelled_per_class):
            raise DataError(
                f"{p}: sessions[{s.index}] ({s.name}) unlabelled pool does not match the protocol's "
                f"(unlabelled={s.unlabelled}, unlabelled_per_class={s.unlabelled_per_class}); {fix}"
            )
    return m


def plans_from_manifest(
    manifest: dict, protocol: Protocol, sources: Mapping[str, DatasetSource], source_path: str = "manifest"
) -> list[SessionPlan]:
    """Session plans read from a checked manifest; every id must exist and come from the session's sources."""
    plans = []
    test_ids = {ref for e in manifest["sessions"] for ref in e["test"]}
    for s, entry in zip(protocol.sessions, manifest["sessions"]):
        allowed = {src.dataset for src in s.sources}
        splits = {k: entry.get(k) for k in ("train", "test", "unlabelled")}
        for split, refs in splits.items():
            for ref in refs or []:
                try:
                    d, rid = split_ref(str(ref))
                except ValueError:
                    raise DataError(
                        f"{source_path}: sessions[{s.index}].{split}: {ref!r} is not a "
                        "'<dataset>/<record id>' sample id; use a manifest of this protocol"
                    ) from None
                if d not in allowed:
                    raise DataError(
                        f"{source_path}: sessions[{s.index}].{split}: {ref} comes from dataset {d!r}, "
                        f"not one of the session's sources {sorted(allowed)}; use a manifest of this protocol"
                    )
                if rid not in sources[d].records:
                    raise DataError(
                        f"{source_path}: sessions[{s.index}].{split}: sample {rid!r} is not in dataset "
                        f"{d} at {sources[d].layout.root}; point --root {sources[d].spec.root} at the "
                        "copy the manifest was made on"
                    )
                if split != "test" and ref in test_ids:
                    raise DataError(
                        f"{source_path}: sessions[{s.index}].{split}: {ref} is also a test sample; "
                        "the manifest mixes training and test data"
                    )
        plans.append(
            SessionPlan(
                s.index,
                s.name,
                list(entry["train"]),
                list(entry["test"]),
                list(entry["unlabelled"]) if entry.get("unlabelled") is not None else None,
            )
        )
    return plans


# ------------------------------------------------------------------------------------------------ lazy splits


def label_lut(protocol: Protocol, source: DatasetSource, session: int) -> Callable[[np.ndarray], np.ndarray]:
    """Native -> global label mapping of ``source`` samples in session ``session`` (see the module docstring)."""
    taught = protocol.taught_from(source.name, session)
    unmapped = 0 if source.spec.unmapped == "background" else IGNORE_INDEX
    values: dict[int, int] = {}
    for native, g in source.native.items():
        values[native] = g if g in (0, IGNORE_INDEX) or g in taught else IGNORE_INDEX
    known = source.known

    def value_of(v: int) -> int:
        if v in values:
            return values[v]
        if known is not None and v not in known:
            return IGNORE_INDEX
        return unmapped

    def apply(label: np.ndarray) -> np.ndarray:
        label = np.asarray(label)
        if label.size == 0:
            return label.astype(np.uint8)
        lo, hi = int(label.min()), int(label.max())
        if lo >= 0 and hi < 1 << 16:
            table = np.fromiter((value_of(v) for v in range(hi + 1)), dtype=np.uint8, count=hi + 1)
            return table[label]
        uniq, inverse = np.unique(label, return_inverse=True)
        return np.array([value_of(int(v)) for v in uniq], dtype=np.uint8)[inverse].reshape(label.shape)

    return apply


class SampleStore:
    """Decodes, preprocesses and caches samples of the opened sources (one decoded sample kept in memory).

    Cache entries (``jascl.data.cache`` under ``<cache>/real/samples/``) hold the preprocessed
    image and *native* label, keyed by the files' paths, sizes and times, the layout options
    and the preprocessing options; label maps are applied on access (they depend on the session).
    """

    def __init__(self, protocol: Protocol, sources: Mapping[str, DatasetSource], cache_dir: Path) -> None:
        self.protocol = protocol
        self.sources = sources
        self.cache_dir = cache_dir
        self._memo: OrderedDict[str, tuple[np.ndarray, np.ndarray | None]] = OrderedDict()

    def preprocess(self, source: DatasetSource, sample: Any) -> tuple[np.ndarray, np.ndarray | None]:
        options = dict(source.spec.preprocess)
        if self.protocol.spatial_dims == 3:
            from jascl.data.medical import preprocess_volume

            return preprocess_volume(sample, options)
        from jascl.data.natural import preprocess_image

        return preprocess_image(sample, options)

    def load(self, ref: str) -> tuple[np.ndarray, np.ndarray | None]:
        """(image (C, *spatial) float32, native label (*spatial) int or None) of sample ``ref``."""
        if ref in self._memo:
            self._memo.move_to_end(ref)
            return self._memo[ref]
        d, rid = split_ref(ref)
        source = self.sources[d]
        record = source.records[rid]

        def compute() -> tuple[np.ndarray, np.ndarray | None]:
            image, label = self.preprocess(source, source.layout.read(record))
            return (
                np.ascontiguousarray(image, dtype=np.float32),
                None if label is None else np.ascontiguousarray(label, dtype=np.int32),
            )

        # keyed by the files (paths, sizes, times), the layout and its options and the preprocessing
        key = [
            PREPROCESS_VERSION,
            source.spec.layout,
            list(record.files),
            dict(source.spec.options),
            dict(source.spec.preprocess),
            self.protocol.spatial_dims,
        ]
        image, label = cached(key, compute, self.cache_dir / "real" / "samples")
        item = (image, label)
        if item[0].ndim != self.protocol.spatial_dims + 1 or item[0].shape[0] != self.protocol.in_channels:
            raise DataError(
                f"{record.images[0]}: preprocessed image has shape {tuple(item[0].shape)}, protocol "
                f"{self.protocol.name} expects {self.protocol.in_channels} channel(s) and "
                f"{self.protocol.spatial_dims} spatial dims; fix in_channels or the layout options"
            )
        self._memo[ref] = item
        while len(self._memo) > 2:
            self._memo.popitem(last=False)
        return item


class SplitBackend:
    """The samples of one split: loads (image, global label) pairs on demand.

    Args:
        store: the shared sample store.
        refs: sample ids ``<dataset>/<record id>``.
        luts: dataset name -> native-to-global mapping of this session.
        crop: if given, every access returns a random crop of this size (zero / ignore
            padded where the sample is smaller), drawn from a seeded stream: unlabelled
            pools are served this way so variable-size volumes batch together.
        seed: seed of the crop stream.
    """

    def __init__(
        self,
        store: SampleStore,
        refs: Sequence[str],
        luts: Mapping[str, Callable],
        crop: Sequence[int] | None = None,
        seed: int = 0,
    ) -> None:
        self.store = store
        self.refs = list(refs)
        self.luts = luts
        self.crop = tuple(int(c) for c in crop) if crop is not None else None
        self.rng = np.random.default_rng([seed, 31337])

        self._last: tuple[int, tuple[np.ndarray, np.ndarray], set[str]] | None = None

    def __len__(self) -> int:
        return len(self.refs)

    def get(self, index: int, part: str) -> tuple[np.ndarray, np.ndarray]:
        """The (image, label) pair of sample ``index``.

        ``split.images[i]`` then ``split.labels[i]`` (how datasets read a pair) get the
        same pair, hence the same random crop; the next read of either part draws anew.
        """
        if self._last is not None and self._last[0] == index and part not in self._last[2]:
            self._last[2].add(part)
            return self._last[1]
        pair = self._load(index)
        self._last = (index, pair, {part})
        return pair

    def _load(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        ref = self.refs[index]
        image, native = self.store.load(ref)
        spatial = image.shape[1:]
        if native is None:
            label = np.full(spatial, IGNORE_INDEX, dtype=np.uint8)  # no ground truth at all
        else:
            label = self.luts[split_ref(ref)[0]](native)
        if self.crop is not None:
            image, label = random_crop(image, label, self.crop, self.rng)
        return image, label


def random_crop(
    image: np.ndarray, label: np.ndarray, size: Sequence[int], rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """A uniformly placed crop of ``size``; image padded with 0 and label with 255 where smaller.

    Shapes: image (C, *spatial), label (*spatial) -> (C, *size), (*size).
    """
    pad = [max(0, s - n) for s, n in zip(size, label.shape)]
    if any(pad):
        widths = [(p // 2, p - p // 2) for p in pad]
        image = np.pad(image, [(0, 0), *widths])
        label = np.pad(label, widths, constant_values=IGNORE_INDEX)
    starts = [int(rng.integers(0, n - s + 1)) for s, n in zip(size, label.shape)]
    box = tuple(slice(a, a + s) for a, s in zip(starts, size))
    return np.ascontiguousarray(image[(slice(None),) + tuple(box)]), np.ascontiguousarray(label[box])


class LazySamples:
    """Array-like view of a split's images (``part="image"``) or labels (``part="label"``).

    See the module docstring for what it supports (indexing, slicing, ``ndim``, ``shape``).
    """

    def __init__(
        self,
        backend: SplitBackend,
        part: str,
        spatial_dims: int,
        channels: int,
        uniform_shape: Sequence[int] | None = None,
    ) -> None:
        self.backend = backend
        self.part = part
        self.ndim = spatial_dims + (2 if part == "image" else 1)
        if backend.crop is not None:
            uniform_shape = backend.crop
        self.uniform = uniform_shape is not None
        spatial = tuple(uniform_shape) if uniform_shape is not None else (None,) * spatial_dims
        self.shape = (len(backend), channels, *spatial) if part == "image" else (len(backend), *spatial)
        self.dtype = np.dtype(np.float32 if part == "image" else np.uint8)

    def __len__(self) -> int:
        return len(self.backend)

    def _one(self, index: int) -> np.ndarray:
        image, label = self.backend.get(index, self.part)
        return image if self.part == "image" else label

    def __getitem__(self, index):
        if isinstance(index, slice):
            items = [self._one(i) for i in range(*index.indices(len(self)))]
            if items and all(a.shape == items[0].shape for a in items):
                return np.stack(items)
            return items
        if isinstance(index, (int, np.integer)):
            i = int(index)
            if i < 0:
                i += len(self)
            if not 0 <= i < len(self):
                raise IndexError(index)
            return self._one(i)
        raise TypeError(f"lazy splits take an integer or a slice, not {type(index).__name__}")

    def __iter__(self):
        for i in range(len(self)):
            yield self._one(i)

    def __array__(self, dtype=None):
        raise TypeError("a lazy split is not held in memory as one array; index it sample by sample")


def lazy_split(
    store: SampleStore,
    refs: Sequence[str],
    luts: Mapping[str, Callable],
    protocol: Protocol,
    crop: Sequence[int] | None = None,
    seed: int = 0,
) -> Split:
    backend = SplitBackend(store, refs, luts, crop, seed)
    args = (protocol.spatial_dims, protocol.in_channels)
    return Split(LazySamples(backend, "image", *args), LazySamples(backend, "label", *args), list(refs))


# ------------------------------------------------------------------------------------------------ entry point


def open_sources(
    protocol: Protocol,
    roots: Mapping[str, Path],
    cache_dir: Path,
    echo: Callable[[str], None] = print,
    problems: list[str] | None = None,
) -> dict[str, DatasetSource]:
    """Open and index every dataset entry whose root is known."""
    out: dict[str, DatasetSource] = {}
    for name, spec in protocol.datasets.items():
        if spec.root not in roots:
            continue
        src = open_source(protocol, spec, roots[spec.root], problems)
        if src is None:
            continue
        src.index(cache_dir, echo=echo, problems=problems)
        out[name] = src
    return out


def load_real(
    protocol: Protocol,
    roots: Mapping[str, str | Path] | None = None,
    cache_dir: str | Path | None = None,
    echo: Callable[[str], None] = print,
    split_manifest: str | Path | None = None,
    roots_file: str | Path | None = None,
    unlabelled_crop: Sequence[int] | None = None,
) -> tuple[list[SessionData], dict]:
    """One :class:`SessionData` per session of a protocol on public datasets, and its manifest.

    Args:
        roots: root name -> folder (``--root``); the roots file and ``JASCL_ROOT_<NAME>`` fill the rest.
        cache_dir: where label indexes and preprocessed samples are cached (default
            ``$JASCL_CACHE`` or ``~/.cache/jascl``).
        split_manifest: a ``manifest.json`` to reuse instead of selecting samples.
        unlabelled_crop: serve unlabelled pools as random crops of this size (the
            training patch), so variable-size samples batch together.

    Raises:
        DataError / ConfigError: one line naming the dataset, session or file and the fix.
    """
    if not protocol.uses_datasets:
        raise ConfigError(f"{protocol.path}: not a protocol on datasets (no 'datasets' section)")
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    resolved = resolve_roots(protocol, roots, roots_file)
    manifest = load_manifest(split_manifest, protocol) if split_manifest is not None else None
    sources = open_sources(protocol, resolved, cache, echo)
    if manifest is not None:
        plans = plans_from_manifest(manifest, protocol, sources, str(split_manifest))
    else:
        plans = plan_sessions(protocol, sources, echo=echo)
    store = SampleStore(protocol, sources, cache)
    data: list[SessionData] = []
    for session, plan in zip(protocol.sessions, plans):
        luts = {name: label_lut(protocol, src, session.index) for name, src in sources.items()}
        train = lazy_split(store, plan.train, luts, protocol)
        test = lazy_split(store, plan.test, luts, protocol)
        unlabelled = (
            lazy_split(store, plan.unlabelled, luts, protocol, crop=unlabelled_crop, seed=protocol.seed + session.index)
            if plan.unlabelled is not None
            else None
        )
        data.append(SessionData(session, train, test, unlabelled))
    return data, manifest_dict(protocol, data, resolved)


def session_summary(protocol: Protocol, plans: Sequence[SessionPlan]) -> list[dict]:
    """Per session: classes and labelled / unlabelled / test counts (for ``jascl data check``)."""
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
                "test": len(p.test),
            }
        )
    return rows


__all__ = [
    "DatasetSource",
    "LazySamples",
    "SampleStore",
    "SessionPlan",
    "SplitBackend",
    "env_var",
    "label_lut",
    "lazy_split",
    "load_manifest",
    "load_real",
    "manifest_dict",
    "open_source",
    "open_sources",
    "parse_root_args",
    "plan_sessions",
    "plans_from_manifest",
    "random_crop",
    "read_roots_file",
    "resolve_roots",
    "select_k_shot",
    "session_summary",
    "split_ref",
]
