"""Detection sessions of a protocol on COCO-format datasets (the built-in ``coco-o``): roots, splits, lazy images.

A detection protocol (``task: detection``) with a ``datasets`` section names COCO-format copies: layout
``coco-o`` (one domain folder of a COCO-O copy, :mod:`jascl.data.coco_o`: ``<root>/<domain>/annotations/
instances_val2017.json`` beside ``<root>/<domain>/val2017/``; option ``folder`` names another domain folder than the
entry's ``domain``) or ``coco`` (any instances JSON and image folder: options ``annotations`` and ``images``, paths
relative to the root). Category names map to the protocol's class names (``labels`` may be left out, or map a
category name or id to a class). :func:`load_detection_datasets` turns them into one
:class:`~jascl.data.types.SessionData` of :class:`~jascl.data.types.DetectionSplit` per session (the
entries are opened by :mod:`jascl.data.detection_entries`, steps 2-3 are :mod:`jascl.data.detection_selection`):

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

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import overload

import numpy as np

from jascl.data.coco_o import check_coco_o
from jascl.data.detection_entries import COCO_LAYOUTS, CocoEntry, entry_paths, open_entry
from jascl.data.detection_selection import DetectionPlan, draw_per_class, hold_out_test, plan_detection_sessions
from jascl.data.real.manifests import load_manifest
from jascl.data.real.roots import resolve_roots
from jascl.data.types import DetectionSplit, SessionData
from jascl.errors import ConfigError, DataError
from jascl.protocols.schema import Protocol

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

_SPLITS = ("train", "test", "unlabelled", "validation")


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
                problems += check_coco(*entry_paths(spec, root))
            except ConfigError as exc:
                problems.append(str(exc))
    if problems:
        return problems
    try:
        load_detection_datasets(protocol, resolved, cache_dir=cache_dir, echo=echo)
    except (DataError, ConfigError) as exc:
        problems.append(str(exc))
    return problems
