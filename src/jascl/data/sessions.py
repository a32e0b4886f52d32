"""The one entry point from a protocol to its data: :func:`load_sessions`.

A protocol (synthetic or on local copies of public datasets), its roots and an
optional split manifest become one :class:`~jascl.data.types.SessionData` per
session: labelled K-shot ``train``, ``test``, the unlabelled pool (with the samples
borrowed from other sources, ``unlabelled_sources``) with the protocol's noise
schedule and the ``validation`` samples of model selection. The
K-shot manifest of what was chosen is written by :func:`write_manifest` and
checked across ranks by :func:`check_same_samples`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from jascl import distributed
from jascl.data.noise import degrade_lazy_pool, degrade_pool
from jascl.data.synthetic import load_or_generate
from jascl.data.types import SessionData, dense
from jascl.errors import DataError
from jascl.fileio import atomic_write_text
from jascl.protocols.schema import Protocol


def load_sessions(
    protocol: Protocol,
    cache_dir: str | Path | None = None,
    echo: Callable[[str], None] = print,
    roots: Mapping[str, str | Path] | None = None,
    split_manifest: str | Path | None = None,
    roots_file: str | Path | None = None,
    patch_size: Sequence[int] | None = None,
    prepare_workers: int = 0,
    progress: bool | None = None,
    stop: Callable[[], bool] | None = None,
) -> list[SessionData]:
    """The protocol's sessions: one :class:`SessionData` per session, unlabelled pools with their noise.

    Synthetic protocols are generated (and cached in ``cache_dir``); protocols on public datasets are
    assembled from the local copies (:func:`jascl.data.real.load_real`: roots from ``roots`` /
    ``roots_file`` / ``JASCL_ROOT_<NAME>``, lazy splits, seeded K-shot selection or the samples of
    ``split_manifest``; unlabelled pool images cropped to ``patch_size``). A ``split_manifest`` given
    for a synthetic protocol must list exactly the generated samples.

    ``prepare_workers`` (a run's key of that name; -1: as many as ``jascl data prepare`` would start): preprocess
    the store entries the sessions read and the store lacks in that many processes first
    (:func:`jascl.data.prepare.fill_store`, with a progress bar when ``progress``, None: on a terminal); 0, and with
    several processes (torchrun), on first access instead. ``stop`` (the run's stop request) ends that
    preprocessing early, keeping what it wrote.
    """
    if protocol.task == "detection":
        if protocol.uses_datasets:
            from jascl.data.detection_real import load_detection_datasets

            return load_detection_datasets(protocol, roots, roots_file, cache_dir, echo, split_manifest)
        from jascl.data.synthetic_det import load_or_generate_detection

        return load_or_generate_detection(protocol, cache_dir, progress=lambda msg: echo(f"[data] {msg}"))
    if protocol.uses_datasets:
        from jascl.data.real import load_real

        fill = None
        if prepare_workers != 0 and not distributed.active():  # ranks would wait for rank 0 past their timeout
            from jascl.data.prepare import fill_store

            def fill(store, refs):
                return fill_store(store, refs, prepare_workers, echo, progress, stop)

        data, _ = load_real(
            protocol,
            roots,
            cache_dir,
            echo,
            split_manifest,
            roots_file,
            unlabelled_crop=list(patch_size) if patch_size is not None else None,
            fill=fill,
        )
        return apply_unlabelled_noise(protocol, data)
    data = load_or_generate(protocol, cache_dir, progress=lambda msg: echo(f"[data] {msg}"))
    if split_manifest is not None:
        _check_synthetic_manifest(protocol, data, split_manifest)
    return apply_unlabelled_noise(protocol, data)


def _check_synthetic_manifest(protocol: Protocol, data: Sequence[SessionData], path: str | Path) -> None:
    """Synthetic samples are a function of (protocol, seed): a reused manifest must name exactly them."""
    from jascl.data.real import load_manifest

    manifest = load_manifest(path, protocol)
    if manifest.get("seed") != protocol.seed:  # synthetic ids are positions; the pixels depend on the seed
        raise DataError(
            f"{path}: made with seed {manifest.get('seed')}, this run has seed {protocol.seed}; synthetic "
            "samples are a function of the seed, so run with --seed "
            f"{manifest.get('seed')} to reuse them"
        )
    for d, entry in zip(data, manifest["sessions"]):
        for split in ("train", "test", "unlabelled", "validation"):
            if split == "validation" and split not in entry:  # a manifest written before validation samples
                continue
            ours = getattr(d, split)
            theirs = entry.get(split)
            if (ours.ids if ours is not None else None) != theirs:
                raise DataError(
                    f"{path}: sessions[{d.session.index}].{split} lists other samples than protocol "
                    f"{protocol.name} generates with seed {protocol.seed}; synthetic samples cannot be "
                    "chosen, so run with the seed the manifest was made with (its 'seed')"
                )


def apply_unlabelled_noise(protocol: Protocol, data: Sequence[SessionData]) -> list[SessionData]:
    """``data`` with the protocol's ``unlabelled_noise`` applied to every unlabelled pool: in memory for synthetic
    pools (:func:`~jascl.data.noise.degrade_pool`), on access for the lazy pools of dataset protocols
    (:class:`~jascl.data.noise.DegradedSamples`); the same 70 % of each pool, the paper's schedules."""
    if protocol.unlabelled_noise == "none":
        return list(data)
    degrade = degrade_lazy_pool if protocol.uses_datasets else degrade_pool
    return [
        dataclasses.replace(
            d, unlabelled=degrade(dense(d.unlabelled), protocol.unlabelled_noise, protocol.seed + d.session.index)
        )
        if d.unlabelled is not None
        else d
        for d in data
    ]


def write_manifest(
    protocol: Protocol, data: Sequence[SessionData], path: Path, roots: Mapping[str, Path] | None = None
) -> None:
    """The K-shot manifest (sample ids of every split, per session) as ``path``; reusable with ``--split-manifest``."""
    from jascl.data.real import manifest_dict

    atomic_write_text(path, json.dumps(manifest_dict(protocol, data, roots), indent=1))


def check_same_samples(protocol: Protocol, data: Sequence[SessionData]) -> None:
    """With several processes: every rank must have drawn the same K-shot samples (else the ranks would train
    on different sessions); a one-line error names the first rank that differs."""
    if not distributed.active():
        return
    import hashlib

    from jascl.data.real import manifest_dict

    digest = hashlib.sha256(json.dumps(manifest_dict(protocol, data, None), sort_keys=True).encode()).hexdigest()
    digests = distributed.all_gather_object(digest)
    for r, other in enumerate(digests):
        if other != digests[0]:
            raise DataError(
                f"rank {r} selected other samples than rank 0 (K-shot manifests differ); every node must "
                "see the same dataset copies and cache: check the roots and --cache-dir on each node"
            )
