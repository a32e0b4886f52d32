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

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

OTHER_CLASS_POLICIES = ("background", "ignore")


METRICS = ("dice", "iou", "map")

#: what a protocol's sessions learn: dense labels (the default) or boxes (``jascl.engine.tasks``)
TASKS = ("segmentation", "detection")


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
        unlabelled_sources: unlabelled samples borrowed from *other* sources (the paper's "additional
            unlabeled CT data" of table ``tab:unlabeled_effect``), joining the session's pool; see
            :class:`UnlabelledSourceSpec` for the key, its checks and the leakage rules.
        validation: labelled validation samples per taught class (0 = none), for model selection
            (``RunConfig.model_selection``); never among the session's training or test samples.
            Synthetic sessions render this many samples per class; sessions on datasets take, per
            class, at least this many samples containing it from the training pool (the paper's
            "Val" columns, e.g. "3 validation samples per class" in Natural-JASCL).
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
    validation: int = 0
    source: str = "synthetic"
    other_classes: str = "background"
    sources: tuple[SourceSpec, ...] = ()
    unlabelled_sources: tuple[UnlabelledSourceSpec, ...] = ()

    @property
    def unlabelled_extra(self) -> int:
        """Unlabelled samples borrowed from other sources (the sum of ``unlabelled_sources`` counts)."""
        return sum(s.count for s in self.unlabelled_sources)

    @property
    def has_unlabelled_pool(self) -> bool:
        """True when the session asks for any unlabelled data (its own or borrowed)."""
        return bool(self.unlabelled or self.unlabelled_per_class or self.unlabelled_extra)

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
class UnlabelledSourceSpec:
    """Unlabelled samples a session borrows from another source: one entry of ``unlabelled_sources``.

    YAML (a session key)::

        unlabelled_sources: [{dataset: ts, count: 11}, {dataset: amos, count: 11}]   # protocols on datasets
        unlabelled_sources: [{domain: ct, count: 14}]                                # synthetic protocols

    The samples join the session's unlabelled pool (after its own ``unlabelled`` /
    ``unlabelled_per_class`` samples): images only, every label pixel 255 (no ground truth, so
    they are not counted in pseudo-label precision); the protocol's ``unlabelled_noise``
    degrades them like the rest of the pool; the split manifest lists them in the session's
    ``unlabelled`` ids and, by source, under ``unlabelled_sources``.

    Rules, checked on load (one line naming the file and the key): exactly one of ``dataset``
    (a key of the protocol's ``datasets`` section, on protocols on datasets) or ``domain`` (a
    declared domain, on synthetic protocols); ``count`` a non-negative integer; a source is
    listed once per session; it is not one of the session's own sources / domains (those fill
    ``unlabelled``) and not first used by a *later* session (that would show the model a future
    session's data); a synthetic domain must be a domain of an earlier session.

    Leakage rules (protocols on datasets, :func:`jascl.data.real.plan_sessions`): the samples come
    from the dataset's training pool and label-free records, never from its test pool, and are
    never a test or validation sample of any session. The strict reading is used for labelled
    data: a borrowed sample is never a labelled training sample of *any* session, earlier ones
    included (the earlier sessions' datasets have far more unlabelled cases than the paper's
    counts need). Samples another session already has in its unlabelled pool are taken last. A
    count larger than what is left is an error naming how many are available. Synthetic sources
    render fresh samples of the domain (their own random streams, objects of the classes the
    earlier sessions taught in it), so they can be no other split's sample. Either way the draw
    is a function of (seed, protocol) and leaves every other split of every session unchanged.

    Attributes:
        count: number of samples borrowed.
        dataset: dataset entry they come from (protocols on datasets), else None.
        domain: synthetic domain they are rendered in (synthetic protocols), else None.
    """

    count: int
    dataset: str | None = None
    domain: str | None = None

    @property
    def name(self) -> str:
        """The dataset entry or domain named."""
        return str(self.dataset if self.dataset is not None else self.domain)


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
        metric: headline metric, "dice" (volumes), "iou" (images) or "map" (COCO mAP, detection).
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
        task: "segmentation" (default) or "detection" (boxes; :class:`~jascl.data.types.DetectionSplit` data,
            a detector, mAP; :mod:`jascl.engine.tasks`).
        session0_of: the protocols whose session 0 this one has unchanged, when it is a variant of them (K shots,
            fewer sessions, borrowed unlabelled data: :func:`jascl.protocols.variants.renamed_variant`): a session-0
            checkpoint made for any of them fits this protocol (:func:`jascl.engine.checkpoint.session_aliases`), so
            the variants' runs can start from one shared base.
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
    task: str = "segmentation"
    session0_of: tuple[str, ...] = ()

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


NOISE_SCHEDULES = ("none", "moderate", "heavy")


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
