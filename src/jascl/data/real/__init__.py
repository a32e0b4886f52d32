"""Sessions of a protocol on public datasets: roots, label maps, K-shot selection, lazy splits.

A protocol's ``datasets`` section names local dataset copies by their on-disk
layout (:mod:`jascl.data.layouts`); its sessions list which dataset teaches which
classes (:class:`~jascl.protocols.schema.SourceSpec`). This module turns that into
one :class:`~jascl.data.types.SessionData` per session, in four steps, one module each
(``roots``, ``sources``, ``selection`` with ``manifests``, ``storage``); :func:`load_real` runs them:

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
   (:func:`select_k_shot`), validation samples (``validation`` per class, from the
   training pool, never trained on), test samples containing the session's classes, and
   unlabelled pools (``unlabelled`` in total and/or ``unlabelled_per_class``) from
   the remaining training samples and label-less records, plus the samples borrowed from
   other datasets (``unlabelled_sources``: images only, never a test, validation or labelled
   sample of any session). Samples already used by
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

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from jascl.data.real.manifests import load_manifest, manifest_dict, plans_from_manifest
from jascl.data.real.roots import env_var, parse_root_args, read_roots_file, resolve_roots
from jascl.data.real.selection import SessionPlan, plan_sessions, select_k_shot, session_summary, split_ref
from jascl.data.real.sources import DatasetSource, open_source
from jascl.data.real.storage import (
    LazySamples,
    SampleStore,
    SplitBackend,
    label_lut,
    lazy_split,
    no_labels,
    random_crop,
)
from jascl.data.synthetic import default_cache_dir
from jascl.data.types import SessionData
from jascl.errors import ConfigError
from jascl.protocols.schema import Protocol


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
    fill: Callable[[SampleStore, list[str]], Any] | None = None,
) -> tuple[list[SessionData], dict]:
    """One :class:`SessionData` per session of a protocol on public datasets, and its manifest.

    Args:
        roots: root name -> folder (``--root``); the roots file and ``JASCL_ROOT_<NAME>`` fill the rest.
        cache_dir: where label indexes and preprocessed samples are cached (default
            ``$JASCL_CACHE`` or ``~/.cache/jascl``).
        split_manifest: a ``manifest.json`` to reuse instead of selecting samples.
        unlabelled_crop: serve unlabelled pools as random crops of this size (the
            training patch), so variable-size samples batch together.
        fill: called with the store and every sample id the sessions read, once they are chosen (a run
            preprocesses the missing ones in parallel: :func:`jascl.data.prepare.fill_store`).

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
    from jascl.data.geometry import check_planned_volumes

    check_planned_volumes(sources, plans)  # a header resampling cannot use stops the run before it trains
    store = SampleStore(protocol, sources, cache)
    if fill is not None:
        parts = ((p.train, p.test, p.unlabelled or [], p.validation or []) for p in plans)
        fill(store, sorted({ref for split in parts for refs in split for ref in refs}))
    data: list[SessionData] = []
    for session, plan in zip(protocol.sessions, plans):
        luts = {name: label_lut(protocol, src, session.index) for name, src in sources.items()}
        train = lazy_split(store, plan.train, luts, protocol)
        test = lazy_split(store, plan.test, luts, protocol)
        # borrowed samples (unlabelled_sources) keep their images only
        pool_luts = {**luts, **{str(u.dataset): no_labels for u in session.unlabelled_sources}}
        unlabelled = (
            lazy_split(
                store, plan.unlabelled, pool_luts, protocol, crop=unlabelled_crop, seed=protocol.seed + session.index
            )
            if plan.unlabelled is not None
            else None
        )
        validation = lazy_split(store, plan.validation, luts, protocol) if plan.validation else None
        data.append(SessionData(session, train, test, unlabelled, validation))
    return data, manifest_dict(protocol, data, resolved)


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
    "no_labels",
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
