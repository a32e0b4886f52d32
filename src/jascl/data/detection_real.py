"""Detection sessions of a protocol on COCO-format datasets (the built-in ``coco-o``): roots, splits, lazy images.

A detection protocol (``task: detection``) with a ``datasets`` section names COCO-format copies: layout
``coco-o`` (one domain folder of a COCO-O copy, :mod:`jascl.data.coco_o`: ``<root>/<domain>/annotations/
instances_val2017.json`` beside ``<root>/<domain>/val2017/``; option ``folder`` names another domain folder than the
entry's ``domain``) or ``coco`` (any instances JSON and image folder: options ``annotations`` and ``images``, paths
relative to the root). Category names map to the protocol's class names (``labels`` may be left out, or map a
category name or id to a class). :func:`load_detection_datasets` turns them into one
:class:`~jascl.data.types.SessionData` of :class:`~jascl.data.types.DetectionSplit` per session:

1. **Roots**: :func:`jascl.data.real.resolve_roots` (``--root NAME=PATH``, a roots file, ``JASCL_ROOT_<NAME>``); a
   root not set, or not a folder, is one :class:`~jascl.errors.DataError` line naming the ``--root`` fix.
2. **Test hold-out** (per dataset entry, independent of the seed so every seed is scored on the same images):
   among the entry's images showing a class some session teaches from it, each class keeps
   ``round(test_fraction x n_c)`` images showing it in the test pool (at most ``n_c - 1``), rarest class first,
   images taken in an order fixed by their ids (a hash), counting images held for other classes.
3. **Selection** (seeded by the protocol's seed; whole images, never one image in two splits of any session):
   the entry's other images, in a seeded order, images an earlier session used left out.

   * ``shots: all``: ``validation`` images per class first (:func:`jascl.data.real.select_k_shot`, an image
     counted for every class it shows, at most half of each class's images), then every remaining image showing
     a session class is a training image (the first ``train`` if capped).
   * ``shots: K``: K images per class, each *drawn for* one class (rarest class first; an image counts only for
     the class it was drawn for); then the unlabelled pool, per class (``datasets.<entry>.options.unlabelled``
     counts, or ``unlabelled_per_class`` each) drawn the same way, or ``unlabelled`` images showing any session
     class; then ``validation`` images per class, drawn the same way (taking them last leaves the shots and the
     pool those of ``validation: 0``).
   * test: the entry's held-out images showing a session class (the first ``test`` if capped).

   Too few images for K shots is a DataError; a short unlabelled pool or validation set is one warning line.
4. **Lazy images** (:class:`LazyImages`): decoded on access as ``(3, H, W)`` float32 RGB in ``[0, 1]``.

Targets (``{"boxes": (M, 4) float32 xyxy pixels, "labels": (M,) int64 global ids}``): boxes from
:func:`jascl.data.coco.load_coco`, clipped to the image size the JSON gives, boxes without area dropped, categories
the protocol does not name dropped. Training splits (``train``, ``unlabelled``: the pool's hidden ground truth)
hold every non-crowd box of the image (the session's loader keeps the classes it teaches). Evaluation splits
(``test``, ``validation``) add ``"iscrowd": (M,) int64``: the boxes of the classes taught from the entry in the
sessions up to this one count, crowd boxes and boxes of other classes are ignore regions (pycocotools'
convention), so a class is scored in the domain(s) where it was taught, as in the segmentation protocols.

Sample ids are ``<dataset entry>/<COCO image id>``; the K-shot manifest (:func:`jascl.data.real.manifest_dict`)
lists them per split and a saved one replaces the selection (``split_manifest``; ids this copy lacks are one
DataError line).

The COCO-O sessions (``coco-o``): see the protocol file's header. The authors' code
(``Detection/tools/prepare_split.py``) splits each class's images independently (60 / 20 / 20 in Painting; in
Weather 30 train per class and the rest 10 : 20 : 41 val / test / unlabelled), so an image can be a training image
of one class and a test image of another; here every image belongs to one split.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import overload

import numpy as np

from jascl.data.coco import CocoSplit, load_coco
from jascl.data.coco_o import check_coco_o, domain_paths
from jascl.data.real.manifests import load_manifest
from jascl.data.real.roots import resolve_roots
from jascl.data.real.selection import select_k_shot
from jascl.data.types import DetectionSplit, SessionData
from jascl.errors import ConfigError, DataError
from jascl.protocols.schema import DatasetSpec, Protocol, SessionSpec

__all__ = [
    "COCO_LAYOUTS",
    "CocoEntry",
    "LazyImages",
    "check_detection_protocol",
    "draw_per_class",
    "hold_out_test",
    "load_detection_datasets",
    "open_entry",
    "plan_detection_sessions",
]

#: the dataset layouts this module reads
COCO_LAYOUTS = ("coco", "coco-o")

_SPLITS = ("train", "test", "unlabelled", "validation")


@dataclass
class CocoEntry:
    """One opened dataset entry: its COCO split and boxes in global ids.

    Attributes:
        spec: the protocol's entry.
        split: the instances JSON as read by :func:`jascl.data.coco.load_coco`.
        label_of: COCO category id -> global class id (categories the protocol maps).
        boxes: image id -> ``(x1, y1, x2, y2, global id, iscrowd)`` rows, clipped to the image, with area.
        shows: image id -> global ids of its non-crowd boxes.
    """

    spec: DatasetSpec
    split: CocoSplit
    label_of: dict[int, int]
    boxes: dict[int, list[tuple[float, float, float, float, int, bool]]]
    shows: dict[int, frozenset[int]]

    @property
    def name(self) -> str:
        return self.spec.name

    def ref(self, image_id: int) -> str:
        """The sample id ``<entry>/<image id>``."""
        return f"{self.spec.name}/{image_id}"

    def images_showing(self, classes: Iterable[int]) -> list[int]:
        """Image ids (JSON order) with a non-crowd box of one of ``classes``."""
        wanted = set(classes)
        return [im.id for im in self.split.images if self.shows[im.id] & wanted]


def _paths(spec: DatasetSpec, root: Path) -> tuple[Path, Path]:
    if spec.layout == "coco-o":
        return domain_paths(root, str(spec.options.get("folder", spec.domain)))
    ann, images = spec.options.get("annotations"), spec.options.get("images")
    if not isinstance(ann, str) or not isinstance(images, str):
        raise ConfigError(
            f"datasets.{spec.name}.options: layout 'coco' needs 'annotations' (the instances JSON) and 'images' "
            "(the image folder), paths relative to the root"
        )
    return root / ann, root / images


def open_entry(protocol: Protocol, spec: DatasetSpec, root: Path) -> CocoEntry:
    """Read one entry's instances JSON (images are not opened) and map its categories to global ids.

    Raises:
        ConfigError: the entry's layout is not a COCO layout, or it names dataset splits.
        DataError: the JSON is missing or malformed (one line naming the file).
    """
    if spec.layout not in COCO_LAYOUTS:
        raise ConfigError(
            f"{protocol.path}: datasets.{spec.name}.layout: detection protocols read COCO-format data "
            f"({', '.join(COCO_LAYOUTS)}), got {spec.layout!r}"
        )
    if spec.test_splits or spec.group_by:
        raise ConfigError(
            f"{protocol.path}: datasets.{spec.name}: a COCO-format entry is one split; hold its test images out "
            "with test_fraction (no test_splits / group_by)"
        )
    json_path, image_dir = _paths(spec, root)
    if not json_path.is_file():
        raise DataError(
            f"{json_path}: instances JSON of dataset {spec.name} not found; point --root {spec.root}=PATH at the "
            "folder ood_coco.zip unpacks into (with its domain folders)"
            if spec.layout == "coco-o"
            else f"{json_path}: instances JSON of dataset {spec.name} not found; check --root {spec.root}=PATH "
            "and the entry's options.annotations"
        )
    split = load_coco(json_path, image_dir)
    names = {c.name: c.id for c in protocol.classes}
    label_of: dict[int, int] = {}
    for cid, cname in split.categories.items():
        target = spec.labels.get(cname, spec.labels.get(cid))
        if target is not None and target in names.values() and target != 0:
            label_of[cid] = target
    by_id = {im.id: im for im in split.images}
    boxes: dict[int, list[tuple[float, float, float, float, int, bool]]] = {im.id: [] for im in split.images}
    for image_id, rows in split.boxes.items():
        im = by_id.get(image_id)
        if im is None:
            continue
        for b in rows:
            gid = label_of.get(b.category_id)
            if gid is None:
                continue
            x1, y1, x2, y2 = b.box
            x1, x2 = min(max(x1, 0.0), im.width), min(max(x2, 0.0), im.width)
            y1, y2 = min(max(y1, 0.0), im.height), min(max(y2, 0.0), im.height)
            if x2 > x1 and y2 > y1:
                boxes[image_id].append((x1, y1, x2, y2, gid, b.iscrowd))
    shows = {i: frozenset(r[4] for r in rows if not r[5]) for i, rows in boxes.items()}
    return CocoEntry(spec, split, label_of, boxes, shows)


# ------------------------------------------------------------------------------------------------ selection


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


# ------------------------------------------------------------------------------------------------ lazy splits


class LazyImages(Sequence[np.ndarray]):
    """Images decoded on access: ``[i]`` is ``(3, H, W)`` float32 RGB in ``[0, 1]``, ``[a:b]`` a list of them.

    Attributes:
        paths: the image files, one per sample.
    """

    ndim = 4
    uniform = False

    def __init__(self, paths: Sequence[Path]) -> None:
        self.paths = list(paths)

    def __len__(self) -> int:
        return len(self.paths)

    @property
    def shape(self) -> tuple[int | None, ...]:
        """``(N, 3, None, None)``: sizes vary and are not known before decoding."""
        return (len(self.paths), 3, None, None)

    @overload
    def __getitem__(self, index: int) -> np.ndarray: ...

    @overload
    def __getitem__(self, index: slice) -> list[np.ndarray]: ...

    def __getitem__(self, index: int | slice) -> np.ndarray | list[np.ndarray]:
        if isinstance(index, slice):
            return [self._read(p) for p in self.paths[index]]
        return self._read(self.paths[index])

    @staticmethod
    def _read(path: Path) -> np.ndarray:
        from PIL import Image

        try:
            with Image.open(path) as f:
                rgb = np.asarray(f.convert("RGB"), dtype=np.float32) / 255.0
        except OSError as exc:
            raise DataError(f"{path}: image missing or unreadable ({exc}); run jascl data check") from None
        return np.ascontiguousarray(rgb.transpose(2, 0, 1))


def _target(e: CocoEntry, image_id: int, measured: frozenset[int] | None) -> dict[str, np.ndarray]:
    """Boxes of one image; ``measured`` None: a training target (non-crowd boxes), else an evaluation target."""
    rows = [r for r in e.boxes[image_id] if measured is not None or not r[5]]
    out: dict[str, np.ndarray] = {
        "boxes": np.array([r[:4] for r in rows], dtype=np.float32).reshape(-1, 4),
        "labels": np.array([r[4] for r in rows], dtype=np.int64),
    }
    if measured is not None:
        out["iscrowd"] = np.array([int(r[5] or r[4] not in measured) for r in rows], dtype=np.int64)
    return out


def _split(
    entries: Mapping[str, CocoEntry], refs: Sequence[str], measured: Mapping[str, frozenset[int]] | None
) -> DetectionSplit:
    paths: list[Path] = []
    targets: list[dict[str, np.ndarray]] = []
    by_id = {name: {im.id: im for im in e.split.images} for name, e in entries.items()}
    for ref in refs:
        name, image_id = _parse_ref(ref)
        e = entries[name]
        paths.append(by_id[name][image_id].path)
        targets.append(_target(e, image_id, measured[name] if measured is not None else None))
    return DetectionSplit(LazyImages(paths), targets, list(refs))


def _parse_ref(ref: str) -> tuple[str, int]:
    name, sep, rid = ref.partition("/")
    if not sep or not rid.lstrip("-").isdigit():
        raise ValueError(ref)
    return name, int(rid)


def _plans_from_manifest(path: str | Path, protocol: Protocol, entries: Mapping[str, CocoEntry]) -> list[DetectionPlan]:
    """The plans a saved manifest lists, checked against this copy (every id present, test never trained on)."""
    manifest = load_manifest(path, protocol)
    test_ids = {r for entry in manifest["sessions"] for r in entry["test"]}
    plans = []
    for s, entry in zip(protocol.sessions, manifest["sessions"]):
        allowed = {src.dataset for src in s.sources}
        for split in _SPLITS:
            for ref in entry.get(split) or []:
                where = f"{path}: sessions[{s.index}].{split}"
                try:
                    name, image_id = _parse_ref(str(ref))
                except ValueError:
                    raise DataError(
                        f"{where}: {ref!r} is not a '<dataset>/<image id>' sample id; use a manifest of this protocol"
                    ) from None
                if name not in allowed:
                    raise DataError(
                        f"{where}: {ref} comes from dataset {name!r}, not one of the session's sources "
                        f"{sorted(allowed)}; use a manifest of this protocol"
                    )
                if image_id not in entries[name].boxes:
                    e = entries[name]
                    raise DataError(
                        f"{where}: image {ref} is not in {e.split.json_path}; point --root {e.spec.root} at the copy "
                        "the manifest was made on"
                    )
                if split != "test" and ref in test_ids:
                    raise DataError(f"{where}: {ref} is also a test image; the manifest mixes training and test data")
        plans.append(
            DetectionPlan(
                list(entry["train"]),
                list(entry["test"]),
                list(entry["unlabelled"]) if entry.get("unlabelled") is not None else None,
                list(entry["validation"]) if entry.get("validation") is not None else None,
            )
        )
    return plans


def _open_entries(protocol: Protocol, roots: Mapping[str, Path]) -> dict[str, CocoEntry]:
    entries: dict[str, CocoEntry] = {}
    for name, spec in protocol.datasets.items():
        root = roots[spec.root]
        if not root.is_dir():
            raise DataError(
                f"{protocol.path}: dataset root {spec.root!r} is {root}, which is not a folder; pass "
                f"--root {spec.root}=PATH with the folder of the copy"
            )
        entries[name] = open_entry(protocol, spec, root)
    return entries


def load_detection_datasets(
    protocol: Protocol,
    roots: Mapping[str, str | Path] | None = None,
    roots_file: str | Path | None = None,
    cache_dir: str | Path | None = None,
    echo: Callable[[str], None] = print,
    split_manifest: str | Path | None = None,
) -> list[SessionData]:
    """One :class:`SessionData` of :class:`DetectionSplit` per session of a detection protocol on COCO-format data.

    Args:
        protocol: a protocol with ``task: detection`` and a ``datasets`` section (layouts ``coco-o`` / ``coco``).
        roots: root name -> folder (``--root``); the roots file and ``JASCL_ROOT_<NAME>`` fill the rest.
        roots_file: a YAML mapping of root names to folders (``--roots``).
        cache_dir: unused (the instances JSONs are read directly; images are decoded on access); accepted for
            the signature the segmentation loader shares.
        echo: where warnings (a class without annotation, a short pool) and the per-session summary go.
        split_manifest: a ``manifest.json`` of an earlier run to reuse instead of selecting images.

    Raises:
        DataError / ConfigError: one line naming the root, file, session or key and the fix.
    """
    del cache_dir
    if protocol.task != "detection" or not protocol.uses_datasets:
        raise ConfigError(f"{protocol.path}: not a detection protocol on datasets (task: detection and 'datasets')")
    resolved = resolve_roots(protocol, roots, roots_file)
    entries = _open_entries(protocol, resolved)
    if split_manifest is not None:
        plans = _plans_from_manifest(split_manifest, protocol, entries)
    else:
        plans = plan_detection_sessions(protocol, entries, echo)
    data: list[SessionData] = []
    for session, plan in zip(protocol.sessions, plans):
        measured = {name: frozenset(protocol.taught_from(name, session.index)) for name in entries}
        data.append(
            SessionData(
                session,
                _split(entries, plan.train, None),
                _split(entries, plan.test, measured),
                _split(entries, plan.unlabelled, None) if plan.unlabelled is not None else None,
                _split(entries, plan.validation, measured) if plan.validation is not None else None,
            )
        )
        sizes = ", ".join(
            f"{len(getattr(plan, k))} {k}" for k in ("train", "unlabelled", "validation", "test") if getattr(plan, k)
        )
        echo(f"[data] {protocol.name} session {session.index} ({session.name}): {sizes} images")
    return data


def check_detection_protocol(
    protocol: Protocol,
    roots: Mapping[str, str | Path] | None = None,
    roots_file: str | Path | None = None,
    cache_dir: str | Path | None = None,
    echo: Callable[[str], None] = print,
) -> list[str]:
    """``jascl data check --protocol`` for detection protocols on COCO-format data: every problem, one line each.

    Checks each COCO-O root with :func:`jascl.data.coco_o.check_coco_o` (each ``coco`` entry with
    :func:`jascl.data.coco.check_coco`), then assembles the sessions (their summary and warnings go to ``echo``).
    """
    from jascl.data.coco import check_coco

    problems: list[str] = []
    resolved = resolve_roots(protocol, roots, roots_file, problems=problems)
    checked: set[Path] = set()
    for spec in protocol.datasets.values():
        root = resolved.get(spec.root)
        if root is None:
            continue
        if spec.layout == "coco-o" and root not in checked:
            checked.add(root)
            problems += check_coco_o(root)
        elif spec.layout == "coco":
            try:
                problems += check_coco(*_paths(spec, root))
            except ConfigError as exc:
                problems.append(str(exc))
    if problems:
        return problems
    try:
        load_detection_datasets(protocol, resolved, cache_dir=cache_dir, echo=echo)
    except (DataError, ConfigError) as exc:
        problems.append(str(exc))
    return problems
