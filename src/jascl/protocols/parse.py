"""Reading a protocol: YAML (or a mapping) checked key by key into the typed specs of :mod:`jascl.protocols.schema`;
every problem is one line naming the file and the key."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from jascl.errors import ConfigError
from jascl.fileio import load_yaml
from jascl.protocols.datasets import _parse_datasets, _parse_sources, check_unlabelled_option
from jascl.protocols.reader import _Reader
from jascl.protocols.schema import (
    APPEARANCE_KEYS,
    METRICS,
    NOISE_SCHEDULES,
    OTHER_CLASS_POLICIES,
    TASKS,
    ClassSpec,
    DatasetSpec,
    DomainSpec,
    Protocol,
    SessionSpec,
    SyntheticSpec,
    UnlabelledSourceSpec,
)

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
    "task",
}


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
    "validation",
    "source",
    "other_classes",
    "sources",
    "unlabelled_sources",
}


_SYNTHETIC_KEYS = {"size", "objects_per_image", "object_radius", "distractors"}


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
    task = r.string(top.get("task", "segmentation"), "task", TASKS)
    default_metric = "map" if task == "detection" else "dice" if spatial_dims == 3 else "iou"
    metric = r.string(top.get("metric", default_metric), "metric", METRICS)
    if task == "detection" and (spatial_dims != 2 or metric != "map"):
        raise r.fail(
            "task",
            f"detection protocols are 2D and scored with metric 'map' (got spatial_dims {spatial_dims}, metric {metric!r})",
        )
    if task == "segmentation" and metric == "map":
        raise r.fail("metric", "'map' scores boxes: set task: detection, or metric dice / iou")

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
    check_unlabelled_sources(r, sessions)
    if task == "detection":  # COCO-format entries' per-class unlabelled pools (datasets.<entry>.options.unlabelled)
        check_unlabelled_option(r, datasets, sessions, classes)
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
    if task == "detection" and noise != "none":
        raise r.fail("unlabelled_noise", "degrades dense labels' boundaries; detection protocols take 'none'")
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
        task=task,
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
    validation = r.integer(e.get("validation", 0), f"{key}.validation", minimum=0)
    if on_datasets:
        if "source" in e:
            raise r.fail(f"{key}.source", "does not apply to a session with 'sources'; remove it")
        source = "datasets"
        sources = _parse_sources(r, e["sources"], f"{key}.sources", new + recurring, doms, datasets)
    else:
        source = r.string(e.get("source", "synthetic"), f"{key}.source")
        sources = ()
    other = r.string(e.get("other_classes", "background"), f"{key}.other_classes", OTHER_CLASS_POLICIES)
    borrowed = _parse_unlabelled_sources(
        r, e.get("unlabelled_sources", []), f"{key}.unlabelled_sources", domains, datasets if on_datasets else None
    )
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
        validation=validation,
        source=source,
        other_classes=other,
        sources=sources,
        unlabelled_sources=borrowed,
    )


def _parse_unlabelled_sources(
    r: _Reader, raw: Any, key: str, domains: Mapping[str, DomainSpec], datasets: Mapping[str, DatasetSpec] | None
) -> tuple[UnlabelledSourceSpec, ...]:
    """``[{dataset: ts, count: 11}, ...]`` (``datasets`` given: a session on datasets) or ``[{domain: ct, count: 14}]``.

    Checks the entries one by one; what depends on the other sessions is :func:`check_unlabelled_sources`.
    """
    if raw is None:
        return ()
    example = "{dataset: <datasets key>, count: N}" if datasets is not None else "{domain: <domain>, count: N}"
    if not isinstance(raw, list):
        raise r.fail(key, f"must be a list of {example} entries (got {raw!r})")
    out: list[UnlabelledSourceSpec] = []
    for j, entry in enumerate(raw):
        ekey = f"{key}[{j}]"
        e = r.mapping(entry, ekey, {"dataset", "domain", "count"}, required={"count"})
        count = e["count"]
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise r.fail(f"{ekey}.count", f"must be a non-negative number of samples (got {count!r}); use 0 or more")
        if datasets is not None:
            if "domain" in e or "dataset" not in e:
                raise r.fail(
                    ekey,
                    f"a session on datasets borrows from a dataset entry: {example} (declared: {', '.join(datasets)})",
                )
            name = r.string(e["dataset"], f"{ekey}.dataset")
            if name not in datasets:
                raise r.fail(
                    f"{ekey}.dataset",
                    f"dataset {name!r} is not declared under 'datasets'; name one of {', '.join(datasets)}",
                )
            spec = UnlabelledSourceSpec(count, dataset=name)
        else:
            if "dataset" in e or "domain" not in e:
                raise r.fail(ekey, f"a synthetic session borrows rendered samples of a domain: {example}")
            name = r.string(e["domain"], f"{ekey}.domain")
            if name not in domains:
                raise r.fail(
                    f"{ekey}.domain",
                    f"domain {name!r} is not declared under 'domains'; name one of {', '.join(domains)}",
                )
            spec = UnlabelledSourceSpec(count, domain=name)
        if any(o.name == name for o in out):
            raise r.fail(ekey, f"lists {name!r} twice; give one entry with the total count")
        out.append(spec)
    return tuple(out)


def check_unlabelled_sources(r: _Reader, sessions: Sequence[SessionSpec]) -> None:
    """The rules of ``unlabelled_sources`` that involve other sessions (:class:`UnlabelledSourceSpec`).

    Raises:
        ConfigError: one line naming the file, the key and the fix.
    """
    for s in sessions:
        for j, src in enumerate(s.unlabelled_sources):
            if src.dataset is not None:
                key = f"sessions[{s.index}].unlabelled_sources[{j}].dataset"
                if any(o.dataset == src.dataset for o in s.sources):
                    raise r.fail(
                        key,
                        f"dataset {src.dataset!r} is one of the session's own sources; its unlabelled samples come "
                        "from 'unlabelled' / 'unlabelled_per_class'",
                    )
                users = [o.index for o in sessions if any(x.dataset == src.dataset for x in o.sources)]
                if users and users[0] > s.index:
                    raise r.fail(
                        key,
                        f"dataset {src.dataset!r} is first used by session {users[0]}, after this one; borrow from "
                        "an earlier session's dataset (or an entry no session uses)",
                    )
            else:
                key = f"sessions[{s.index}].unlabelled_sources[{j}].domain"
                if src.domain in s.domains:
                    raise r.fail(
                        key,
                        f"domain {src.domain!r} is one of the session's own domains; its unlabelled samples come "
                        "from 'unlabelled' / 'unlabelled_per_class'",
                    )
                earlier = list(dict.fromkeys(d for o in sessions[: s.index] for d in o.domains))
                if src.domain not in earlier:
                    raise r.fail(
                        key,
                        f"domain {src.domain!r} is not a domain of an earlier session; borrow from one of "
                        f"{', '.join(earlier) or '(none: the base session cannot borrow)'}",
                    )


def load_protocol(path: str | Path) -> Protocol:
    """Read and validate a protocol YAML file."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{p}: protocol file not found; run 'jascl protocols' to list built-ins")
    try:
        data = load_yaml(p.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}:" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{p.name}:{where} not valid YAML ({problem})") from None
    return dataclasses.replace(parse_protocol(data, source=p.name, name=p.stem), file=str(p.resolve()))
