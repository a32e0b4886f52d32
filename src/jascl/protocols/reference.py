"""Every key of a protocol YAML file, documented from the parser and the schema (the docs' protocol reference).

``docs/protocol-reference.md`` is generated from :func:`reference_sections` when the site is built
(``docs/hooks.py``, marker ``<!-- generated:protocol-reference -->``). What can be read from the code is read
from it, so the page cannot drift:

* the keys of each section are the parser's own key sets (:mod:`jascl.protocols.parse`,
  :mod:`jascl.protocols.datasets`);
* descriptions come from the ``Attributes`` sections of the schema's dataclasses
  (:mod:`jascl.protocols.schema`) where a key is an attribute, defaults from their fields;
* allowed values come from the constants the parser checks against (``METRICS``, ``TASKS``, ...).

What is written here is the YAML type in words, a default where the parser computes one, and one example
per key. ``tests/test_protocol_reference.py`` checks that every parser key is documented (and nothing else),
that every example parses inside a small protocol, and that the documented defaults are what the parser gives.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from dataclasses import dataclass
from typing import Any

from jascl.protocols import datasets as _datasets
from jascl.protocols import parse as _parse
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
    SourceSpec,
    SyntheticSpec,
    UnlabelledSourceSpec,
)

REQUIRED = "required"


@dataclass(frozen=True)
class Key:
    """One documented key.

    Attributes:
        name: the YAML key.
        type: its YAML type, in words.
        example: one YAML example (the key and its value, as written in its section).
        default: the default in words (None: the schema field's default; :data:`REQUIRED`: no default).
        allowed: the values it takes (None: from ``choices``, else "").
        doc: a description (None: the schema class's ``Attributes`` entry of the same name).
        attribute: the schema attribute it fills, when its name differs.
    """

    name: str
    type: str
    example: str
    default: str | None = None
    allowed: str | None = None
    doc: str | None = None
    attribute: str | None = None


@dataclass(frozen=True)
class Section:
    """A section of the file: its path (``sessions[]``), the schema class it fills, its keys, the parser's key set."""

    path: str
    title: str
    schema: type | None
    keys: tuple[Key, ...]
    parser_keys: frozenset[str]
    intro: str = ""


def attribute_docs(cls: type) -> dict[str, str]:
    """``name -> description`` from a class docstring's Google-style ``Attributes:`` section (continuation lines
    joined; ``a / b:`` and ``a, b:`` entries give each name the same text)."""
    doc = inspect.getdoc(cls) or ""
    out: dict[str, str] = {}
    inside, current = False, None
    for line in doc.splitlines():
        if line.strip() == "Attributes:":
            inside = True
            continue
        if not inside:
            continue
        if line and not line.startswith(" "):
            break
        entry = re.match(r"^ {4}(\w[\w ,/]*):\s*(.*)$", line)
        if entry:
            current = [n.strip() for n in re.split(r"[,/]", entry.group(1)) if n.strip()]
            for name in current:
                out[name] = entry.group(2).strip()
        elif current and line.strip():
            for name in current:
                out[name] += " " + line.strip()
    return out


def _choices(values) -> str:
    return ", ".join(f"`{v}`" for v in values)


def _field_default(cls: type | None, name: str) -> str:
    for f in dataclasses.fields(cls) if cls is not None else ():
        if f.name == name:
            if f.default is not dataclasses.MISSING:
                value = f.default
            elif f.default_factory is not dataclasses.MISSING:
                value = f.default_factory()
            else:
                return REQUIRED
            return "none" if value is None else f"`{_yaml(value)}`"
    return REQUIRED


def _yaml(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_yaml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_yaml(v)}" for k, v in value.items()) + "}"
    return str(value)


TOP = Section(
    "",
    "The file",
    Protocol,
    (
        Key("name", "string", "name: my-ct-study", "the file's name without `.yaml`"),
        Key(
            "description",
            "string",
            "description: two CT datasets, liver then spleen",
            '`""`',
            doc="one line shown by `jascl protocols`",
        ),
        Key("seed", "integer >= 0", "seed: 1024", "`1024`"),
        Key("spatial_dims", "2 or 3", "spatial_dims: 3", "`2`", "`2` (images), `3` (volumes)"),
        Key("in_channels", "integer >= 1", "in_channels: 1", "`1`"),
        Key("metric", "string", "metric: dice", "`dice` for 3D, `iou` for 2D, `map` for detection", _choices(METRICS)),
        Key("task", "string", "task: segmentation", "`segmentation`", _choices(TASKS)),
        Key("classes", "list of class entries (below)", "classes: [{id: 0, name: background}, {id: 1, name: liver}]"),
        Key("domains", "mapping: domain name -> domain entry (below)", "domains: {ct: {}, mr: {}}", "`{}`"),
        Key(
            "sessions",
            "list of session entries (below)",
            "sessions: [{domains: [ct], new_classes: [1], shots: all, sources: [ct]}]",
        ),
        Key(
            "datasets",
            "mapping: entry name -> dataset entry (below)",
            "datasets: {ct: {layout: msd, labels: {1: liver}}}",
            "`{}` (a synthetic protocol)",
            doc="the local dataset copies of a protocol on datasets, by entry name (sample ids are "
            "`<entry>/<record id>`); a protocol has either `datasets` or `synthetic`",
        ),
        Key(
            "synthetic",
            "mapping (below)",
            "synthetic: {size: 64}",
            "none (a protocol on datasets)",
            doc="the embedded generator's options: a synthetic protocol renders its data",
        ),
        Key(
            "training",
            "mapping of run-configuration keys (below)",
            "training: {patch_size: [96, 96, 96], epochs_base: 50}",
            "`{}`",
            doc="run-configuration defaults for this protocol; `--config` and `--set` override them",
        ),
        Key("unlabelled_noise", "string", "unlabelled_noise: moderate", "`none`", _choices(NOISE_SCHEDULES)),
    ),
    frozenset(_parse._TOP_KEYS),
    "Only `classes` and `sessions` are required; a protocol on your own data also has `datasets`.",
)

CLASSES = Section(
    "classes[]",
    "A class entry",
    ClassSpec,
    (
        Key("id", "integer >= 0, not 255", "id: 1", doc="global class id; 0 is background (declare it), 255 is ignore"),
        Key("name", "string", "name: liver", doc="class name, unique; `labels` may map to it by name"),
        Key("shape", "string", "shape: disc", doc="the synthetic shape family of the class (synthetic protocols only)"),
    ),
    frozenset({"id", "name", "shape"}),
)

DOMAINS = Section(
    "domains.<name>",
    "A domain entry",
    DomainSpec,
    (
        Key("description", "string", "description: portal-venous CT", '`""`', doc="what the domain is, in words"),
        Key(
            "appearance",
            "mapping (synthetic protocols)",
            "appearance: {invert: true, noise: 0.02}",
            "`{}`",
            _choices(sorted(APPEARANCE_KEYS)),
            doc="how the synthetic renderer draws this domain",
        ),
    ),
    frozenset({"description", "appearance"}),
    "A domain with nothing to say is `{}`, e.g. `domains: {ct: {}, mr: {}}`.",
)

SESSIONS = Section(
    "sessions[]",
    "A session entry",
    SessionSpec,
    (
        Key("name", "string", "name: spleen", "`base` for the first session, `session<i>` after it"),
        Key("domains", "domain name or list of them", "domains: [mr]", REQUIRED),
        Key("new_classes", "list of class ids", "new_classes: [3]", REQUIRED),
        Key("recurring_classes", "list of class ids", "recurring_classes: [1]", "`[]`"),
        Key("shots", "integer >= 1 or `all`", "shots: 5", "`all` in the first session; required after it"),
        Key(
            "train",
            "integer >= 1 (or `all` on datasets)",
            "train: 40",
            "required with `shots: all` on synthetic data; every eligible sample on datasets",
        ),
        Key("test", "integer >= 1 (or `all` on datasets)", "test: 10", "`1` synthetic; `all` on datasets"),
        Key("unlabelled", "integer >= 0", "unlabelled: 20", "`0`"),
        Key("unlabelled_per_class", "integer >= 0", "unlabelled_per_class: 2", "`0`"),
        Key("validation", "integer >= 0", "validation: 3", "`0`"),
        Key(
            "source",
            "string",
            "source: synthetic",
            "`synthetic`; `datasets` (set for you) with `sources`",
            doc="the data source of a session without `sources`",
        ),
        Key("other_classes", "string", "other_classes: ignore", "`background`", _choices(OTHER_CLASS_POLICIES)),
        Key(
            "sources",
            "dataset entry name, or list of names / {dataset, classes} entries (below)",
            "sources: [mr]",
            "required on datasets",
        ),
        Key(
            "unlabelled_sources",
            "list of {dataset or domain, count} entries (below)",
            "unlabelled_sources: [{dataset: ct, count: 2}]",
            "`[]`",
            doc="unlabelled samples borrowed from another source (an earlier session's dataset, or a synthetic "
            "domain), joining the session's pool; never a test, validation or labelled sample",
        ),
    ),
    frozenset(_parse._SESSION_KEYS),
)

SOURCES = Section(
    "sessions[].sources[]",
    "A source entry",
    SourceSpec,
    (
        Key("dataset", "dataset entry name", "dataset: mr", REQUIRED),
        Key("classes", "list of class ids", "classes: [3]", "every session class the dataset maps"),
    ),
    frozenset({"dataset", "classes"}),
    "A bare name (`sources: [mr]`) is `{dataset: mr}`.",
)

UNLABELLED_SOURCES = Section(
    "sessions[].unlabelled_sources[]",
    "A borrowed unlabelled source",
    UnlabelledSourceSpec,
    (
        Key("dataset", "dataset entry name", "dataset: ct", "none", doc="on datasets: the entry they come from"),
        Key("domain", "domain name", "domain: ct", "none", doc="on synthetic data: the domain they are rendered in"),
        Key("count", "integer >= 0", "count: 2", REQUIRED),
    ),
    frozenset({"dataset", "domain", "count"}),
)

DATASETS = Section(
    "datasets.<name>",
    "A dataset entry",
    DatasetSpec,
    (
        Key("layout", "string", "layout: msd", REQUIRED, doc=None),
        Key("root", "string", "root: my_ct", "the entry's name"),
        Key("domain", "domain name", "domain: ct", "the entry's name"),
        Key(
            "labels",
            "mapping: native label id or name -> class id, class name, `background` or `ignore`",
            "labels: {1: liver, 2: spleen, 3: ignore}",
            "required (COCO layouts: every class by its name)",
        ),
        Key("options", "mapping (the layout's options)", "options: {include_test: false}", "`{}`"),
        Key("unmapped", "string", "unmapped: ignore", None, _choices(OTHER_CLASS_POLICIES)),
        Key("train_splits", "list of strings", "train_splits: [train]"),
        Key("test_splits", "list of strings", "test_splits: [test]"),
        Key("test_fraction", "number in (0, 0.9]", "test_fraction: 0.3"),
        Key("group_by", "string", "group_by: subject"),
        Key("preprocess", "mapping (below)", "preprocess: {spacing: [1.5, 1.5, 2.0], intensity: ct}", "`{}`"),
    ),
    frozenset(_datasets._DATASET_KEYS),
    "The root's path is never in the protocol: `--root NAME=PATH`, a `--roots` file or `JASCL_ROOT_<NAME>` "
    "give it (`jascl data check` tells you which is missing).",
)

SYNTHETIC = Section(
    "synthetic",
    "The synthetic generator",
    SyntheticSpec,
    (
        Key("size", "integer >= 16, or one per spatial axis", "size: [64, 64]", REQUIRED, doc="image / volume size"),
        Key(
            "objects_per_image", "[min, max] integers >= 1", "objects_per_image: [1, 2]", doc="objects drawn per sample"
        ),
        Key(
            "object_radius",
            "[min, max] fractions of the size in [0.02, 0.5]",
            "object_radius: [0.1, 0.2]",
            doc="object radius as a fraction of the size",
        ),
        Key("distractors", "integer >= 0", "distractors: 0", doc="objects of untaught classes drawn per sample"),
    ),
    frozenset(_parse._SYNTHETIC_KEYS),
)

#: the sections in the page's order
SECTIONS: tuple[Section, ...] = (TOP, CLASSES, DOMAINS, SESSIONS, SOURCES, UNLABELLED_SOURCES, DATASETS, SYNTHETIC)


def key_rows(section: Section) -> list[dict[str, str]]:
    """One row per key: name, type, default, allowed, description, example (markdown)."""
    docs = attribute_docs(section.schema) if section.schema is not None else {}
    rows = []
    for key in section.keys:
        attribute = key.attribute or key.name
        rows.append(
            {
                "key": key.name,
                "type": key.type,
                "default": key.default if key.default is not None else _field_default(section.schema, attribute),
                "allowed": key.allowed or "",
                "doc": key.doc if key.doc is not None else docs.get(attribute, ""),
                "example": key.example,
            }
        )
    return rows


def reference_sections() -> list[tuple[Section, list[dict[str, str]]]]:
    """Every section with its rows (what the docs hook renders)."""
    return [(s, key_rows(s)) for s in SECTIONS]
