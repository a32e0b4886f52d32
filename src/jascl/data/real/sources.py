"""Dataset sources: a layout's records as training, test and label-less pools, the native labels each labelled
sample contains (read once and cached), and the label map from native ids to the protocol's classes."""

from __future__ import annotations

import hashlib
import json
import re
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from jascl.data.types import id_counts
from jascl.errors import ConfigError, DataError
from jascl.fileio import atomic_write_text
from jascl.protocols.schema import IGNORE_INDEX, DatasetSpec, Protocol

#: per spatial dims, bumped when the cached preprocessed samples of that kind change meaning: volumes went to 2
#: (resampled in float32) and then to 3 (resampled axis by axis, ``jascl.data.resample``) on 2026-11-28; 2D images
#: stay at 1, so their store entries stay valid
PREPROCESS_VERSIONS = {2: 1, 3: 3}


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
        todo = self.unindexed(cache_dir, record_ids)
        if todo:
            ahead = "; 'jascl data prepare' reads them in parallel, ahead of a run" if len(todo) >= 16 else ""
            echo(
                f"[data] {self.name}: reading {len(todo)} label file(s) to index their classes (cached afterwards)"
                + ahead
            )
        found: dict[str, tuple[str, list[int]]] = {}
        for n, (rid, sig) in enumerate(todo):
            try:
                label = read_native_label(self.layout, self.records[rid])
            except DataError as exc:
                if problems is None:
                    raise
                problems.append(str(exc))
                self.excluded.add(rid)
                continue
            found[rid] = (sig, present_values(label))
            if (n + 1) % 200 == 0:
                self.add_index(cache_dir, found)
                found = {}
        if found:
            self.add_index(cache_dir, found)

    def index_file(self, cache_dir: Path) -> Path:
        """Where the native labels of this copy's samples are cached (per layout, root and layout options)."""
        key = hashlib.sha1(
            f"{self.spec.layout}|{Path(self.layout.root).resolve()}|"
            f"{json.dumps(dict(self.spec.options), sort_keys=True, default=str)}".encode()
        ).hexdigest()[:12]
        return cache_dir / "real" / f"labels-{self.spec.layout}-{key}.json"

    def _stored_index(self, cache_dir: Path) -> dict:
        path = self.index_file(cache_dir)
        try:
            return json.loads(path.read_text()) if path.is_file() else {}
        except (OSError, json.JSONDecodeError):
            return {}

    def unindexed(self, cache_dir: Path, record_ids: Iterable[str] | None = None) -> list[tuple[str, str]]:
        """(record id, file signature) of the records whose native labels are not cached for their files as they
        are now; the others' go into :attr:`presence`. Default records: both pools, less the excluded."""
        ids = [
            r
            for r in (record_ids if record_ids is not None else self.train_pool + self.test_pool)
            if r not in self.excluded
        ]
        stored = self._stored_index(cache_dir)
        todo = []
        for rid in ids:
            sig = _signature(self.records[rid].files)
            entry = stored.get(rid)
            if entry and entry.get("sig") == sig:
                self.presence[rid] = frozenset(entry["labels"])
            else:
                todo.append((rid, sig))
        return todo

    def add_index(self, cache_dir: Path, found: Mapping[str, tuple[str, list[int]]]) -> None:
        """Record the native labels ``found`` (record id -> (file signature, ids present)) in :attr:`presence`
        and in the cache file (read again and merged, written atomically)."""
        stored = self._stored_index(cache_dir)
        for rid, (sig, values) in found.items():
            self.presence[rid] = frozenset(values)
            stored[rid] = {"sig": sig, "labels": sorted(int(v) for v in values)}
        _atomic_json(self.index_file(cache_dir), stored)


def read_native_label(layout: Any, record: Any) -> np.ndarray:
    """The native label array of a record, decoding as little as the layout allows: the layout's ``read_label``
    (which must return what its ``read`` gives as the sample's label, without the image), else ``decode_label``
    of the label file, else the whole sample's ``read``."""
    if hasattr(layout, "read_label"):
        return np.asarray(layout.read_label(record))
    if hasattr(layout, "decode_label") and record.label is not None and not Path(record.label).is_dir():
        return np.asarray(layout.decode_label(Path(record.label))[0])
    sample = layout.read(record)
    if sample.label is None:
        raise DataError(f"{record.label or record.id}: the layout read no label for this sample")
    return np.asarray(sample.label)


def present_values(label: np.ndarray) -> list[int]:
    """The native ids a label array holds, ascending."""
    return [int(v) for v in id_counts(label)[0]]


def _atomic_json(path: Path, payload: Any) -> None:
    atomic_write_text(path, json.dumps(payload))


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
