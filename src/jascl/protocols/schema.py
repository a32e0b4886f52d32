"""Benchmark protocols as data: YAML files parsed into typed, validated dataclasses.

A protocol declares the global class list (id 0 is background), the imaging
domains, and an ordered list of sessions. Each session names its domain(s), the
classes it introduces, the classes that recur from an earlier session in a new
domain, the labelled shots K per class (``all`` for a fully labelled base
session), an optional unlabelled pool and the split sizes. Every problem is
reported as one line naming the file and the key, e.g.::

    synthetic-2d.yaml: sessions[2].shots: must be a positive integer or 'all' (got -3)

Protocols on public datasets (the paper's benchmarks) add a ``datasets`` section:
one entry per local dataset copy, naming its on-disk layout
(:mod:`jascl.data.layouts`), the *name* of its root folder (the path itself comes
from ``--root NAME=PATH``, a roots file or ``JASCL_ROOT_<NAME>``, never from the
protocol), its imaging domain, and the map from the dataset's native label ids to
the protocol's global class ids. Sessions then list their ``sources``: which
dataset entries teach which of the session's classes. A class that recurs in a
new domain (Med JASCL-Mixed, Natural-JASCL) is mapped to the *same* global id by
the new domain's dataset entry. Session assembly (K-shot selection, splits,
manifests) lives in :mod:`jascl.data.real`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from jascl.errors import ConfigError

OTHER_CLASS_POLICIES = ("background", "ignore")
METRICS = ("dice", "iou")
#: global id of "ignore" in labels and label maps: excluded from losses, prototypes and metrics. The one
#: definition every module imports.
IGNORE_INDEX = 255


@dataclass(frozen=True)
class ClassSpec:
    """One global class. ``shape`` names the synthetic shape family (synthetic protocols only)."""

    id: int
    name: str
    shape: str | None = None


@dataclass(frozen=True)
class DomainSpec:
    """An imaging domain. ``appearance`` parametrises the synthetic renderer (see ``jascl.data.synthetic``)."""

    name: str
    description: str = ""
    appearance: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SessionSpec:
    """One continual-learning session.

    Attributes:
        index: position in the sequence (0 = base session).
        name: short label used in tables and folder names.
        domains: imaging domain(s) the session's data comes from.
        new_classes: classes introduced here (first time labelled).
        recurring_classes: classes introduced earlier, labelled again here in a new domain.
        shots: labelled samples per class (K), or None for "all" (base session).
        train: number of labelled training samples when ``shots`` is "all".
        test: number of test samples.
        unlabelled: size of the unlabelled pool drawn from the session's domain (0 = none).
        unlabelled_per_class: additional unlabelled samples per taught class, each
            showing that class (as in Semi-Supervised Natural-JASCL).
        source: data source ("synthetic", "datasets" when ``sources`` are given, or
            another free-form name for data passed in by the caller).
        other_classes: what the training labels of classes not taught in this
            session become: "background" (the authors' convention) or "ignore".
        sources: dataset sources of a protocol on public datasets: which dataset
            entry teaches which of the session's classes (empty for synthetic data).
            For such sessions ``train`` (shots "all") and ``test`` are optional caps,
            None meaning every eligible sample.
    """

    index: int
    name: str
    domains: tuple[str, ...]
    new_classes: tuple[int, ...]
    recurring_classes: tuple[int, ...] = ()
    shots: int | None = None
    train: int | None = None
    test: int | None = 1
    unlabelled: int = 0
    unlabelled_per_class: int = 0
    source: str = "synthetic"
    other_classes: str = "background"
    sources: tuple[SourceSpec, ...] = ()

    @property
    def classes(self) -> tuple[int, ...]:
        """Foreground classes labelled in this session (new then recurring)."""
        return self.new_classes + self.recurring_classes

    @property
    def is_base(self) -> bool:
        return self.index == 0

    @property
    def num_labelled(self) -> int:
        """Labelled training samples: K per taught class, or ``train`` for "all"."""
        if self.shots is None:
            return int(self.train or 0)
        return self.shots * len(self.classes)


@dataclass(frozen=True)
class SourceSpec:
    """One dataset feeding a session: the dataset entry and the session classes it teaches.

    Attributes:
        dataset: key of an entry of the protocol's ``datasets`` section.
        classes: global ids of the session's classes labelled from this dataset.
    """

    dataset: str
    classes: tuple[int, ...]


@dataclass(frozen=True)
class DatasetSpec:
    """A local copy of a public dataset, as one protocol uses it.

    Attributes:
        name: the entry's key in ``datasets`` (sample ids in manifests are ``<name>/<record id>``).
        layout: registered on-disk layout (``jascl.data.layouts.LAYOUTS``: msd, totalsegmentator,
            brats, cityscapes, idd, bdd100k, cholecseg8k, m2caiseg, ...).
        root: name of the root folder, resolved from ``--root NAME=PATH``, a roots file or
            the environment variable ``JASCL_ROOT_<NAME>`` (see :func:`jascl.data.real.resolve_roots`).
        domain: the imaging domain of the dataset's samples.
        options: layout options (e.g. the TotalSegmentator structure list).
        labels: native label (id, or name as the layout reports it) -> global class id;
            ``IGNORE_INDEX`` (255) marks native labels to ignore. Several native labels may share
            a global id; a class recurring in a new domain maps to its existing global id.
        unmapped: what native labels that are known to the layout but absent from ``labels``
            become: "background" (0) or "ignore" (255).
        train_splits: the dataset's own splits (``Record.split``) whose labelled samples form
            the training pool.
        test_splits: the dataset's own splits forming the test pool; empty = hold out
            ``test_fraction`` of the training pool (seeded, grouped by ``group_by``).
        test_fraction: fraction of the training pool held out for testing when
            ``test_splits`` is empty.
        group_by: ``Record.meta`` key keeping related samples (a video, a subject) on one
            side of the hold-out split; None = every sample is its own group.
        preprocess: options of the preprocessing function (``jascl.data.medical.preprocess_volume``
            for volumes, ``jascl.data.natural.preprocess_image`` for images).
    """

    name: str
    layout: str
    root: str
    domain: str
    labels: Mapping[int | str, int]
    options: Mapping[str, Any] = field(default_factory=dict)
    unmapped: str = "background"
    train_splits: tuple[str, ...] = ("train",)
    test_splits: tuple[str, ...] = ()
    test_fraction: float = 0.2
    group_by: str | None = None
    preprocess: Mapping[str, Any] = field(default_factory=dict)

    def targets(self) -> set[int]:
        """Global class ids this dataset provides labels for (ignore excluded)."""
        return {g for g in self.labels.values() if g not in (0, IGNORE_INDEX)}


@dataclass(frozen=True)
class SyntheticSpec:
    """Options of the embedded synthetic generator (``jascl.data.synthetic``)."""

    size: tuple[int, ...]
    objects_per_image: tuple[int, int] = (1, 3)
    object_radius: tuple[float, float] = (0.12, 0.22)
    distractors: int = 1


@dataclass(frozen=True)
class Protocol:
    """A validated benchmark protocol.

    Attributes:
        name: protocol name (the YAML file stem for built-ins).
        path: file it was read from (for messages and provenance).
        seed: seed of the data generation, K-shot selection and training.
        spatial_dims: 2 (images) or 3 (volumes).
        in_channels: image channels.
        metric: headline metric, "dice" (volumes) or "iou" (images).
        classes: global class list; ``classes[0]`` is background (id 0).
        domains: declared domains by name.
        sessions: sessions in order.
        synthetic: generator options when the data source is synthetic.
        training: recommended training defaults (validated by ``jascl.engine.config``).
        unlabelled_noise: boundary-aware degradation of unlabelled pools: "none",
            "moderate" or "heavy" (the paper's limitations section, ``jascl.data.noise``).
        datasets: local dataset copies by entry name, for protocols on public datasets
            (empty for synthetic protocols).
        file: absolute path of the YAML file it was read from (None when parsed from a mapping).
    """

    name: str
    path: str
    seed: int
    spatial_dims: int
    in_channels: int
    metric: str
    classes: tuple[ClassSpec, ...]
    domains: Mapping[str, DomainSpec]
    sessions: tuple[SessionSpec, ...]
    description: str = ""
    synthetic: SyntheticSpec | None = None
    training: Mapping[str, Any] = field(default_factory=dict)
    unlabelled_noise: str = "none"
    datasets: Mapping[str, DatasetSpec] = field(default_factory=dict)
    file: str | None = None

    @property
    def uses_datasets(self) -> bool:
        """True for protocols on public datasets (their data is assembled by ``jascl.data.real``)."""
        return bool(self.datasets)

    def class_id(self, name: str) -> int:
        for c in self.classes:
            if c.name == name:
                return c.id
        raise KeyError(name)

    def taught_from(self, dataset: str, upto: int) -> set[int]:
        """Global ids taught from dataset entry ``dataset`` in sessions ``0..upto``."""
        out: set[int] = set()
        for s in self.sessions[: upto + 1]:
            for src in s.sources:
                if src.dataset == dataset:
                    out.update(src.classes)
        return out

    def class_name(self, class_id: int) -> str:
        for c in self.classes:
            if c.id == class_id:
                return c.name
        raise KeyError(class_id)

    def seen_classes(self, session: int) -> list[int]:
        """Global ids of all classes seen up to and including ``session``, background first."""
        seen = [0]
        for s in self.sessions[: session + 1]:
            seen.extend(c for c in s.new_classes if c not in seen)
        return seen

    def base_classes(self) -> list[int]:
        return list(self.sessions[0].new_classes)


# --------------------------------------------------------------------------- parsing


class _Reader:
    """Walks a YAML mapping and reports problems as ``file: key.path: message``."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, key: str, message: str) -> ConfigError:
        return ConfigError(f"{self.source}: {key}: {message}" if key else f"{self.source}: {message}")

    def mapping(self, value: Any, key: str, allowed: set[str], required: Collection[str] = frozenset()) -> dict:
        if not isinstance(value, Mapping):
            raise self.fail(key, f"must be a mapping (got {type(value).__name__})")
        for k in value:
            if k not in allowed:
                raise self.fail(
                    f"{key}.{k}" if key else str(k), f"unknown key; allowed keys: {', '.join(sorted(allowed))}"
                )
        for k in sorted(required):
            if k not in value:
                raise self.fail(f"{key}.{k}" if key else k, "is required")
        return dict(value)

    def integer(self, value: Any, key: str, minimum: int | None = None) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(key, f"must be an integer (got {value!r})")
        if minimum is not None and value < minimum:
            raise self.fail(key, f"must be >= {minimum} (got {value})")
        return value

    def number(self, value: Any, key: str, lo: float | None = None, hi: float | None = None) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.fail(key, f"must be a number (got {value!r})")
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise self.fail(key, f"must be in [{lo}, {hi}] (got {value})")
        return float(value)

    def string(self, value: Any, key: str, choices: tuple[str, ...] | None = None) -> str:
        if not isinstance(value, str) or not value:
            raise self.fail(key, f"must be a non-empty string (got {value!r})")
        if choices is not None and value not in choices:
            raise self.fail(key, f"must be one of {', '.join(choices)} (got {value!r})")
        return value

    def int_list(self, value: Any, key: str) -> tuple[int, ...]:
        if not isinstance(value, list):
            raise self.fail(key, f"must be a list of class ids (got {value!r})")
        return tuple(self.integer(v, f"{key}[{i}]", minimum=0) for i, v in enumerate(value))


_TOP_KEYS = {
    "name",
    "description",
    "seed",
    "spatial_dims",
    "in_channels",
    "metric",
    "classes",
    "domains",
    "sessions",
    "synthetic",
    "training",
    "unlabelled_noise",
    "datasets",
}
NOISE_SCHEDULES = ("none", "moderate", "heavy")
_SESSION_KEYS = {
    "name",
    "domains",
    "new_classes",
    "recurring_classes",
    "shots",
    "train",
    "test",
    "unlabelled",
    "unlabelled_per_class",
    "source",
    "other_classes",
    "sources",
}
_DATASET_KEYS = {
    "layout",
    "root",
    "domain",
    "options",
    "labels",
    "unmapped",
    "train_splits",
    "test_splits",
    "test_fraction",
    "group_by",
    "preprocess",
}
_SYNTHETIC_KEYS = {"size", "objects_per_image", "object_radius", "distractors"}
APPEARANCE_KEYS = {
    "background",
    "class_intensity",
    "jitter",
    "noise",
    "speckle",
    "blur",
    "texture",
    "invert",
    "bias_field",
    "gamma",
}


def parse_protocol(data: Any, source: str = "<protocol>", name: str | None = None) -> Protocol:
    """Validate a protocol mapping (already loaded from YAML) into a :class:`Protocol`.

    Raises:
        ConfigError: one line naming ``source`` and the offending key.
    """
    r = _Reader(source)
    top = r.mapping(data, "", _TOP_KEYS, required={"classes", "sessions"})
    proto_name = r.string(top.get("name", name or Path(source).stem), "name")
    seed = r.integer(top.get("seed", 1024), "seed", minimum=0)
    spatial_dims = r.integer(top.get("spatial_dims", 2), "spatial_dims")
    if spatial_dims not in (2, 3):
        raise r.fail("spatial_dims", f"must be 2 or 3 (got {spatial_dims})")
    in_channels = r.integer(top.get("in_channels", 1), "in_channels", minimum=1)
    metric = r.string(top.get("metric", "dice" if spatial_dims == 3 else "iou"), "metric", METRICS)

    classes = _parse_classes(r, top["classes"])
    class_ids = {c.id for c in classes}
    domains = _parse_domains(r, top.get("domains", {}))
    synthetic = _parse_synthetic(r, top["synthetic"], spatial_dims) if "synthetic" in top else None
    datasets = _parse_datasets(r, top.get("datasets", {}), classes, domains)
    if datasets and synthetic is not None:
        raise r.fail("datasets", "a protocol is either synthetic (a 'synthetic' section) or on datasets; remove one")

    raw_sessions = top["sessions"]
    if not isinstance(raw_sessions, list) or not raw_sessions:
        raise r.fail("sessions", "must be a non-empty list of sessions")
    sessions: list[SessionSpec] = []
    introduced: set[int] = set()
    for i, raw in enumerate(raw_sessions):
        s = _parse_session(r, raw, i, class_ids, introduced, domains, datasets)
        if s.source == "synthetic" and synthetic is None:
            raise r.fail(f"sessions[{i}].source", "is 'synthetic' but the protocol has no 'synthetic' section")
        introduced.update(s.new_classes)
        sessions.append(s)
    never = sorted(class_ids - introduced - {0})
    if never:
        raise r.fail(
            "classes",
            f"class id(s) {never} are declared but no session introduces them; add them to a session's new_classes or remove them",
        )
    if synthetic is not None:
        for c in classes:
            if c.id != 0 and not c.shape:
                raise r.fail(f"classes[id={c.id}].shape", "synthetic protocols need a shape for every foreground class")
    training = top.get("training", {}) or {}
    if not isinstance(training, Mapping):
        raise r.fail("training", "must be a mapping of run-configuration defaults")
    noise = r.string(top.get("unlabelled_noise", "none"), "unlabelled_noise", NOISE_SCHEDULES)
    return Protocol(
        unlabelled_noise=noise,
        name=proto_name,
        path=source,
        seed=seed,
        spatial_dims=spatial_dims,
        in_channels=in_channels,
        metric=metric,
        classes=classes,
        domains=domains,
        sessions=tuple(sessions),
        description=str(top.get("description", "")),
        synthetic=synthetic,
        training=dict(training),
        datasets=datasets,
    )


def _parse_classes(r: _Reader, raw: Any) -> tuple[ClassSpec, ...]:
    if not isinstance(raw, list) or not raw:
        raise r.fail("classes", "must be a non-empty list of {id, name} entries")
    out: list[ClassSpec] = []
    seen_ids: set[int] = set()
    seen_names: set[str] = set()
    for i, entry in enumerate(raw):
        e = r.mapping(entry, f"classes[{i}]", {"id", "name", "shape"}, required={"id", "name"})
        cid = r.integer(e["id"], f"classes[{i}].id", minimum=0)
        cname = r.string(e["name"], f"classes[{i}].name")
        if cid in seen_ids:
            raise r.fail(f"classes[{i}].id", f"duplicate class id {cid}")
        if cname in seen_names:
            raise r.fail(f"classes[{i}].name", f"duplicate class name {cname!r}")
        if cid == 255:
            raise r.fail(f"classes[{i}].id", "255 is reserved for 'ignore'")
        shape = r.string(e["shape"], f"classes[{i}].shape") if "shape" in e else None
        seen_ids.add(cid)
        seen_names.add(cname)
        out.append(ClassSpec(cid, cname, shape))
    if 0 not in seen_ids:
        raise r.fail("classes", "class id 0 (background) must be declared")
    out.sort(key=lambda c: c.id)
    return tuple(out)


def _parse_domains(r: _Reader, raw: Any) -> dict[str, DomainSpec]:
    if not isinstance(raw, Mapping):
        raise r.fail("domains", "must be a mapping from domain name to its description")
    out: dict[str, DomainSpec] = {}
    for dname, entry in raw.items():
        key = f"domains.{dname}"
        e = r.mapping(entry or {}, key, {"description", "appearance"})
        appearance = r.mapping(e.get("appearance", {}) or {}, f"{key}.appearance", APPEARANCE_KEYS)
        for k, v in appearance.items():
            akey = f"{key}.appearance.{k}"
            if k == "invert":
                if not isinstance(v, bool):
                    raise r.fail(akey, f"must be true or false (got {v!r})")
            elif k == "class_intensity":
                if not (isinstance(v, list) and len(v) == 2):
                    raise r.fail(akey, f"must be a [low, high] pair (got {v!r})")
                lo, hi = (r.number(x, akey, 0.0, 1.0) for x in v)
                if lo > hi:
                    raise r.fail(akey, f"low must not exceed high (got {v!r})")
            elif k in ("background", "gamma"):
                r.number(v, akey, 0.0, 10.0)
            else:
                r.number(v, akey, 0.0, 5.0)
        out[str(dname)] = DomainSpec(str(dname), str(e.get("description", "")), appearance)
    return out


def _parse_synthetic(r: _Reader, raw: Any, spatial_dims: int) -> SyntheticSpec:
    e = r.mapping(raw, "synthetic", _SYNTHETIC_KEYS, required={"size"})
    size = e["size"]
    if isinstance(size, int) and not isinstance(size, bool):
        size = [size] * spatial_dims
    if not isinstance(size, list) or len(size) != spatial_dims:
        raise r.fail("synthetic.size", f"must be an integer or a list of {spatial_dims} integers (got {size!r})")
    size_t = tuple(r.integer(v, "synthetic.size", minimum=16) for v in size)
    opi = e.get("objects_per_image", [1, 3])
    if not (isinstance(opi, list) and len(opi) == 2):
        raise r.fail("synthetic.objects_per_image", f"must be a [min, max] pair (got {opi!r})")
    lo, hi = (r.integer(v, "synthetic.objects_per_image", minimum=1) for v in opi)
    if lo > hi:
        raise r.fail("synthetic.objects_per_image", f"min must not exceed max (got {opi!r})")
    rad = e.get("object_radius", [0.12, 0.22])
    if not (isinstance(rad, list) and len(rad) == 2):
        raise r.fail("synthetic.object_radius", f"must be a [min, max] pair of image fractions (got {rad!r})")
    rlo, rhi = (r.number(v, "synthetic.object_radius", 0.02, 0.5) for v in rad)
    if rlo > rhi:
        raise r.fail("synthetic.object_radius", f"min must not exceed max (got {rad!r})")
    distractors = r.integer(e.get("distractors", 1), "synthetic.distractors", minimum=0)
    return SyntheticSpec(size_t, (lo, hi), (rlo, rhi), distractors)


def _parse_session(
    r: _Reader,
    raw: Any,
    i: int,
    class_ids: set[int],
    introduced: set[int],
    domains: Mapping[str, DomainSpec],
    datasets: Mapping[str, DatasetSpec] | None = None,
) -> SessionSpec:
    key = f"sessions[{i}]"
    e = r.mapping(raw, key, _SESSION_KEYS, required={"domains", "new_classes"})
    datasets = datasets or {}
    on_datasets = "sources" in e
    if datasets and not on_datasets:
        raise r.fail(
            f"{key}.sources",
            "is required: the protocol has a 'datasets' section, so every session names "
            "its dataset sources, e.g. sources: [amos]",
        )
    if on_datasets and not datasets:
        raise r.fail(f"{key}.sources", "names dataset entries but the protocol has no 'datasets' section")
    name = r.string(e.get("name", "base" if i == 0 else f"session{i}"), f"{key}.name")
    doms = e["domains"]
    if isinstance(doms, str):
        doms = [doms]
    if not isinstance(doms, list) or not doms:
        raise r.fail(f"{key}.domains", "must be a domain name or a non-empty list of domain names")
    for j, d in enumerate(doms):
        r.string(d, f"{key}.domains[{j}]")
        if domains and d not in domains:
            raise r.fail(
                f"{key}.domains[{j}]", f"domain {d!r} is not declared under 'domains' (declared: {', '.join(domains)})"
            )
    new = r.int_list(e["new_classes"], f"{key}.new_classes")
    recurring = r.int_list(e.get("recurring_classes", []), f"{key}.recurring_classes")
    for j, c in enumerate(new):
        ckey = f"{key}.new_classes[{j}]"
        if c == 0:
            raise r.fail(ckey, "background (0) is implicit in every session; do not list it")
        if c not in class_ids:
            raise r.fail(ckey, f"class id {c} is used before it is declared; add it to 'classes'")
        if c in introduced:
            raise r.fail(
                ckey, f"class {c} was already introduced by an earlier session; list it under recurring_classes"
            )
    if len(set(new)) != len(new):
        raise r.fail(f"{key}.new_classes", "lists a class twice")
    for j, c in enumerate(recurring):
        ckey = f"{key}.recurring_classes[{j}]"
        if c not in class_ids:
            raise r.fail(ckey, f"class id {c} is used before it is declared; add it to 'classes'")
        if c not in introduced:
            raise r.fail(ckey, f"class {c} recurs before any earlier session introduced it")
        if c in new:
            raise r.fail(ckey, f"class {c} is both new and recurring")
    if not new and not recurring:
        raise r.fail(key, "teaches no class; give new_classes or recurring_classes")

    shots_raw = e.get("shots", "all" if i == 0 else None)
    if shots_raw is None:
        raise r.fail(f"{key}.shots", "is required for incremental sessions (a positive integer K, or 'all')")
    if shots_raw == "all":
        shots = None
        if on_datasets:  # optional cap; every eligible labelled sample by default
            train_raw = e.get("train", "all")
            train = None if train_raw == "all" else r.integer(train_raw, f"{key}.train", minimum=1)
        elif "train" not in e:
            raise r.fail(f"{key}.train", "is required when shots is 'all' (number of labelled training samples)")
        else:
            train = r.integer(e["train"], f"{key}.train", minimum=1)
    else:
        if isinstance(shots_raw, bool) or not isinstance(shots_raw, int) or shots_raw < 1:
            raise r.fail(f"{key}.shots", f"must be a positive integer or 'all' (got {shots_raw!r})")
        shots = shots_raw
        if "train" in e:
            raise r.fail(
                f"{key}.train", "only applies when shots is 'all'; a K-shot session has K x classes labelled samples"
            )
        train = None
    if on_datasets:  # optional cap; every eligible test sample by default
        test_raw = e.get("test", "all")
        test = None if test_raw == "all" else r.integer(test_raw, f"{key}.test", minimum=1)
    else:
        test = r.integer(e.get("test", 1), f"{key}.test", minimum=1)
    unlabelled = r.integer(e.get("unlabelled", 0), f"{key}.unlabelled", minimum=0)
    per_class = r.integer(e.get("unlabelled_per_class", 0), f"{key}.unlabelled_per_class", minimum=0)
    if on_datasets:
        if "source" in e:
            raise r.fail(f"{key}.source", "does not apply to a session with 'sources'; remove it")
        source = "datasets"
        sources = _parse_sources(r, e["sources"], f"{key}.sources", new + recurring, doms, datasets)
    else:
        source = r.string(e.get("source", "synthetic"), f"{key}.source")
        sources = ()
    other = r.string(e.get("other_classes", "background"), f"{key}.other_classes", OTHER_CLASS_POLICIES)
    return SessionSpec(
        index=i,
        name=name,
        domains=tuple(doms),
        new_classes=new,
        recurring_classes=recurring,
        shots=shots,
        train=train,
        test=test,
        unlabelled=unlabelled,
        unlabelled_per_class=per_class,
        source=source,
        other_classes=other,
        sources=sources,
    )


def _parse_sources(
    r: _Reader, raw: Any, key: str, classes: tuple[int, ...], domains: list[str], datasets: Mapping[str, DatasetSpec]
) -> tuple[SourceSpec, ...]:
    """``sources: [amos]`` or ``[{dataset: bdd, classes: [15, 16]}, {dataset: idd, classes: [7]}]``.

    A bare dataset name teaches every session class that the dataset maps.
    """
    if isinstance(raw, str):
        raw = [raw]
    if not isinstance(raw, list) or not raw:
        raise r.fail(key, "must be a dataset name or a non-empty list of dataset names / {dataset, classes} entries")
    out: list[SourceSpec] = []
    covered: set[int] = set()
    for j, entry in enumerate(raw):
        ekey = f"{key}[{j}]"
        if isinstance(entry, str):
            entry = {"dataset": entry}
        e = r.mapping(entry, ekey, {"dataset", "classes"}, required={"dataset"})
        name = r.string(e["dataset"], f"{ekey}.dataset")
        if name not in datasets:
            raise r.fail(
                f"{ekey}.dataset",
                f"dataset {name!r} is not declared under 'datasets' (declared: {', '.join(datasets)})",
            )
        spec = datasets[name]
        if spec.domain not in domains:
            raise r.fail(
                f"{ekey}.dataset",
                f"dataset {name!r} is in domain {spec.domain!r}, which is not among the "
                f"session's domains {domains}; add it to the session's domains",
            )
        if "classes" in e:
            taught = r.int_list(e["classes"], f"{ekey}.classes")
            for k, c in enumerate(taught):
                if c not in classes:
                    raise r.fail(
                        f"{ekey}.classes[{k}]", f"class {c} is not one of the session's classes {list(classes)}"
                    )
                if c not in spec.targets():
                    raise r.fail(
                        f"{ekey}.classes[{k}]",
                        f"dataset {name!r} has no label mapped to class {c}; add it to datasets.{name}.labels",
                    )
        else:
            taught = tuple(c for c in classes if c in spec.targets())
            if not taught:
                raise r.fail(ekey, f"dataset {name!r} maps none of the session's classes {list(classes)}")
        covered.update(taught)
        out.append(SourceSpec(name, tuple(taught)))
    missing = [c for c in classes if c not in covered]
    if missing:
        raise r.fail(key, f"class(es) {missing} have no source; list a dataset that maps them")
    return tuple(out)


def _parse_datasets(
    r: _Reader, raw: Any, classes: tuple[ClassSpec, ...], domains: Mapping[str, DomainSpec]
) -> dict[str, DatasetSpec]:
    if not isinstance(raw, Mapping):
        raise r.fail("datasets", "must be a mapping from dataset entry name to {layout, root, labels, ...}")
    by_name = {c.name: c.id for c in classes}
    ids = {c.id for c in classes}
    out: dict[str, DatasetSpec] = {}
    for dname, entry in raw.items():
        key = f"datasets.{dname}"
        name = r.string(str(dname), key)
        if "/" in name:
            raise r.fail(key, "entry names must not contain '/' (sample ids are '<entry>/<record id>')")
        e = r.mapping(entry, key, _DATASET_KEYS, required={"layout", "labels"})
        layout = r.string(e["layout"], f"{key}.layout")
        root = r.string(e.get("root", name), f"{key}.root")
        domain = r.string(e.get("domain", name), f"{key}.domain")
        if domains and domain not in domains:
            raise r.fail(
                f"{key}.domain", f"domain {domain!r} is not declared under 'domains' (declared: {', '.join(domains)})"
            )
        labels_raw = e["labels"]
        if not isinstance(labels_raw, Mapping) or not labels_raw:
            raise r.fail(f"{key}.labels", "must be a non-empty mapping native label -> global class (id or name)")
        labels: dict[int | str, int] = {}
        for native, target in labels_raw.items():
            lkey = f"{key}.labels.{native}"
            if (
                isinstance(native, bool)
                or not isinstance(native, (int, str))
                or native == ""
                or (isinstance(native, int) and native < 0)
            ):
                raise r.fail(lkey, "native labels are non-negative integers or label names")
            if isinstance(target, bool):
                raise r.fail(lkey, f"must be a class id or name (got {target!r})")
            if target == "ignore":
                gid = IGNORE_INDEX
            elif target == "background":
                gid = 0
            elif isinstance(target, int):
                if target not in ids and target != IGNORE_INDEX:
                    raise r.fail(lkey, f"class id {target} is not declared in 'classes'")
                gid = target
            elif isinstance(target, str) and target in by_name:
                gid = by_name[target]
            else:
                raise r.fail(lkey, f"{target!r} is neither a declared class id / name nor 'background' / 'ignore'")
            labels[native] = gid
        unmapped = r.string(e.get("unmapped", "background"), f"{key}.unmapped", OTHER_CLASS_POLICIES)
        options = _free_mapping(r, e.get("options"), f"{key}.options")
        preprocess = _free_mapping(r, e.get("preprocess"), f"{key}.preprocess")
        train_splits = _string_list(r, e.get("train_splits", ["train"]), f"{key}.train_splits")
        if not train_splits:
            raise r.fail(f"{key}.train_splits", "must name at least one split of the dataset")
        test_splits = _string_list(r, e.get("test_splits", []), f"{key}.test_splits")
        overlap = sorted(set(train_splits) & set(test_splits))
        if overlap:
            raise r.fail(f"{key}.test_splits", f"split(s) {overlap} are also training splits; a sample cannot be both")
        fraction = r.number(e.get("test_fraction", 0.2), f"{key}.test_fraction", 0.0, 0.9)
        if not test_splits and fraction <= 0:
            raise r.fail(f"{key}.test_fraction", "must be > 0 when test_splits is empty (there would be no test data)")
        group_by = r.string(e["group_by"], f"{key}.group_by") if e.get("group_by") is not None else None
        out[name] = DatasetSpec(
            name=name,
            layout=layout,
            root=root,
            domain=domain,
            labels=labels,
            options=options,
            unmapped=unmapped,
            train_splits=train_splits,
            test_splits=test_splits,
            test_fraction=fraction,
            group_by=group_by,
            preprocess=preprocess,
        )
    return out


def _free_mapping(r: _Reader, value: Any, key: str) -> dict:
    """A mapping whose keys are checked by its consumer (a layout, a preprocessing function)."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise r.fail(key, f"must be a mapping (got {value!r})")
    return dict(value)


def _string_list(r: _Reader, value: Any, key: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        raise r.fail(key, f"must be a list of split names (got {value!r})")
    return tuple(r.string(v, f"{key}[{i}]") for i, v in enumerate(value))


def load_protocol(path: str | Path) -> Protocol:
    """Read and validate a protocol YAML file."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{p}: protocol file not found; run 'jascl protocols' to list built-ins")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}:" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{p.name}:{where} not valid YAML ({problem})") from None
    return dataclasses.replace(parse_protocol(data, source=p.name, name=p.stem), file=str(p.resolve()))
