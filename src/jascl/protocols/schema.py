"""Benchmark protocols as data: YAML files parsed into typed, validated dataclasses.

A protocol declares the global class list (id 0 is background), the imaging
domains, and an ordered list of sessions. Each session names its domain(s), the
classes it introduces, the classes that recur from an earlier session in a new
domain, the labelled shots K per class (``all`` for a fully labelled base
session), an optional unlabelled pool and the split sizes. Every problem is
reported as one line naming the file and the key, e.g.::

    synthetic-2d.yaml: sessions[2].shots: must be a positive integer or 'all' (got -3)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml

from jascl.errors import ConfigError

OTHER_CLASS_POLICIES = ("background", "ignore")
METRICS = ("dice", "iou")


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
        source: data source ("synthetic", or a dataset name for real data).
        other_classes: what the training labels of classes not taught in this
            session become: "background" (the authors' convention) or "ignore".
    """

    index: int
    name: str
    domains: tuple[str, ...]
    new_classes: tuple[int, ...]
    recurring_classes: tuple[int, ...] = ()
    shots: int | None = None
    train: int | None = None
    test: int = 1
    unlabelled: int = 0
    unlabelled_per_class: int = 0
    source: str = "synthetic"
    other_classes: str = "background"

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
        training: recommended training defaults (validated by ``jascl.training.config``).
        unlabelled_noise: boundary-aware degradation of unlabelled pools: "none",
            "moderate" or "heavy" (the paper's limitations section, ``jascl.data.noise``).
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

    def mapping(self, value: Any, key: str, allowed: set[str], required: set[str] = frozenset()) -> dict:
        if not isinstance(value, Mapping):
            raise self.fail(key, f"must be a mapping (got {type(value).__name__})")
        for k in value:
            if k not in allowed:
                raise self.fail(f"{key}.{k}" if key else str(k), f"unknown key; allowed keys: {', '.join(sorted(allowed))}")
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


_TOP_KEYS = {"name", "description", "seed", "spatial_dims", "in_channels", "metric", "classes", "domains",
             "sessions", "synthetic", "training", "unlabelled_noise"}
NOISE_SCHEDULES = ("none", "moderate", "heavy")
_SESSION_KEYS = {"name", "domains", "new_classes", "recurring_classes", "shots", "train", "test", "unlabelled",
                 "unlabelled_per_class", "source", "other_classes"}
_SYNTHETIC_KEYS = {"size", "objects_per_image", "object_radius", "distractors"}
APPEARANCE_KEYS = {"background", "class_intensity", "jitter", "noise", "speckle", "blur", "texture", "invert",
                   "bias_field", "gamma"}


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

    raw_sessions = top["sessions"]
    if not isinstance(raw_sessions, list) or not raw_sessions:
        raise r.fail("sessions", "must be a non-empty list of sessions")
    sessions: list[SessionSpec] = []
    introduced: set[int] = set()
    for i, raw in enumerate(raw_sessions):
        s = _parse_session(r, raw, i, class_ids, introduced, domains)
        if s.source == "synthetic" and synthetic is None:
            raise r.fail(f"sessions[{i}].source", "is 'synthetic' but the protocol has no 'synthetic' section")
        introduced.update(s.new_classes)
        sessions.append(s)
    never = sorted(class_ids - introduced - {0})
    if never:
        raise r.fail("classes", f"class id(s) {never} are declared but no session introduces them; add them to a session's new_classes or remove them")
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
        name=proto_name, path=source, seed=seed, spatial_dims=spatial_dims, in_channels=in_channels,
        metric=metric, classes=classes, domains=domains, sessions=tuple(sessions),
        description=str(top.get("description", "")), synthetic=synthetic, training=dict(training),
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


def _parse_session(r: _Reader, raw: Any, i: int, class_ids: set[int], introduced: set[int],
                   domains: Mapping[str, DomainSpec]) -> SessionSpec:
    key = f"sessions[{i}]"
    e = r.mapping(raw, key, _SESSION_KEYS, required={"domains", "new_classes"})
    name = r.string(e.get("name", "base" if i == 0 else f"session{i}"), f"{key}.name")
    doms = e["domains"]
    if isinstance(doms, str):
        doms = [doms]
    if not isinstance(doms, list) or not doms:
        raise r.fail(f"{key}.domains", "must be a domain name or a non-empty list of domain names")
    for j, d in enumerate(doms):
        r.string(d, f"{key}.domains[{j}]")
        if domains and d not in domains:
            raise r.fail(f"{key}.domains[{j}]", f"domain {d!r} is not declared under 'domains' (declared: {', '.join(domains)})")
    new = r.int_list(e["new_classes"], f"{key}.new_classes")
    recurring = r.int_list(e.get("recurring_classes", []), f"{key}.recurring_classes")
    for j, c in enumerate(new):
        ckey = f"{key}.new_classes[{j}]"
        if c == 0:
            raise r.fail(ckey, "background (0) is implicit in every session; do not list it")
        if c not in class_ids:
            raise r.fail(ckey, f"class id {c} is used before it is declared; add it to 'classes'")
        if c in introduced:
            raise r.fail(ckey, f"class {c} was already introduced by an earlier session; list it under recurring_classes")
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
        if "train" not in e:
            raise r.fail(f"{key}.train", "is required when shots is 'all' (number of labelled training samples)")
        train = r.integer(e["train"], f"{key}.train", minimum=1)
    else:
        if isinstance(shots_raw, bool) or not isinstance(shots_raw, int) or shots_raw < 1:
            raise r.fail(f"{key}.shots", f"must be a positive integer or 'all' (got {shots_raw!r})")
        shots = shots_raw
        if "train" in e:
            raise r.fail(f"{key}.train", "only applies when shots is 'all'; a K-shot session has K x classes labelled samples")
        train = None
    test = r.integer(e.get("test", 1), f"{key}.test", minimum=1)
    unlabelled = r.integer(e.get("unlabelled", 0), f"{key}.unlabelled", minimum=0)
    per_class = r.integer(e.get("unlabelled_per_class", 0), f"{key}.unlabelled_per_class", minimum=0)
    source = r.string(e.get("source", "synthetic"), f"{key}.source")
    other = r.string(e.get("other_classes", "background"), f"{key}.other_classes", OTHER_CLASS_POLICIES)
    return SessionSpec(i, name, tuple(doms), new, recurring, shots, train, test, unlabelled, per_class, source, other)


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
    return parse_protocol(data, source=p.name, name=p.stem)
