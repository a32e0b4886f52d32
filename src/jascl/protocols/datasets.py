"""Reading the ``datasets`` section of a protocol on public datasets and the sessions' ``sources``.

COCO-format entries (layouts in :data:`NAME_MAPPED_LAYOUTS`, read by :mod:`jascl.data.detection_real`) name their
categories, so ``labels`` may be left out: every protocol class then maps the category of the same name. In a
detection protocol such an entry may give per-class unlabelled pool sizes as ``options: {unlabelled: {bench: 41,
car: 224}}`` (class names or ids taught from the entry); the session teaching those classes then sets
``unlabelled`` to their sum (:func:`check_unlabelled_option`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jascl.protocols.reader import _free_mapping, _Reader, _string_list
from jascl.protocols.schema import (
    IGNORE_INDEX,
    OTHER_CLASS_POLICIES,
    ClassSpec,
    DatasetSpec,
    DomainSpec,
    SessionSpec,
    SourceSpec,
)

#: layouts whose native labels are category names (COCO-format instances JSONs): ``labels`` is optional, every
#: protocol class then maps the category of the same name
NAME_MAPPED_LAYOUTS = ("coco", "coco-o")

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
        e = r.mapping(entry, key, _DATASET_KEYS, required={"layout"})
        layout = r.string(e["layout"], f"{key}.layout")
        if "labels" not in e:
            if layout not in NAME_MAPPED_LAYOUTS:
                raise r.fail(f"{key}.labels", "is required")
            e["labels"] = {c.name: c.id for c in classes if c.id != 0}
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


def check_unlabelled_option(
    r: _Reader, datasets: Mapping[str, DatasetSpec], sessions: list[SessionSpec], classes: tuple[ClassSpec, ...]
) -> None:
    """Per-class unlabelled pool sizes of detection protocols: ``datasets.<entry>.options.unlabelled``.

    Each key is a class (name or id) that some session teaches from the entry, each value a non-negative
    count; a session teaching such classes sets ``unlabelled`` to the sum of their counts (so its manifest
    and summaries count the pool) and no ``unlabelled_per_class``.

    Raises:
        ConfigError: one line naming the file and the key.
    """
    by_name = {c.name: c.id for c in classes}
    counts: dict[str, dict[int, int]] = {}
    for name, spec in datasets.items():
        raw = spec.options.get("unlabelled")
        if raw is None:
            continue
        key = f"datasets.{name}.options.unlabelled"
        if not isinstance(raw, Mapping) or not raw:
            raise r.fail(key, "must be a mapping class (name or id) -> unlabelled images, e.g. {bench: 41, car: 224}")
        taught = {c for s in sessions for src in s.sources if src.dataset == name for c in src.classes}
        out: dict[int, int] = {}
        for cls, n in raw.items():
            cid = by_name.get(cls, cls) if isinstance(cls, str) else cls
            if isinstance(cid, bool) or not isinstance(cid, int) or cid not in taught:
                raise r.fail(f"{key}.{cls}", f"is not a class that a session teaches from dataset {name!r}")
            out[cid] = r.integer(n, f"{key}.{cls}", minimum=0)
        counts[name] = out
    for s in sessions:
        total = sum(counts[src.dataset].get(c, 0) for src in s.sources if src.dataset in counts for c in src.classes)
        if not any(c in counts.get(src.dataset, {}) for src in s.sources for c in src.classes):
            continue
        if s.unlabelled_per_class:
            raise r.fail(
                f"sessions[{s.index}].unlabelled_per_class",
                "does not combine with the per-class counts of datasets.<entry>.options.unlabelled; remove it",
            )
        if s.unlabelled != total:
            raise r.fail(
                f"sessions[{s.index}].unlabelled",
                f"must be {total}, the sum of the per-class unlabelled counts its datasets' options.unlabelled give "
                f"(got {s.unlabelled})",
            )
