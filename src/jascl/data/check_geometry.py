"""``jascl data check``'s look at every volume's shape *after* preprocessing, read from its header; and the
session plans it checks (a new selection or a run's split manifest) with the held-out cases they imply.

A volume can be sound as a file and still be unusable once ``preprocess`` has reoriented and resampled it:
a header spacing of 0.01 mm resampled to 1.5 mm leaves a 1-voxel-wide volume, a 20 mm spacing resampled
to 0.5 mm a volume of billions of voxels. :func:`planned_shape_report` computes the shape every volume will
have (:func:`jascl.data.geometry.planned_shape`, nothing is resampled) and reports

* a problem per volume whose planned shape collapses or exceeds the voxel limit (the sample is left out);
* one note per dataset for volumes smaller than the training patch along an axis: they are padded to it
  (image 0, label ignored) for training, and every whole-volume forward pads them to what the backbone
  takes (:meth:`jascl.networks.Backbone.input_size`), so they train and evaluate, but mostly on padding
  when much smaller.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from jascl.data.geometry import planned_shape_problem


def planned_shape_report(sources: Mapping[str, Any], patch_size: Sequence[int] | None) -> tuple[list[str], list[str]]:
    """(problems, notes) for the 3D volumes of the opened ``sources`` (name -> :class:`DatasetSource`).

    Samples with a problem are added to their source's ``excluded`` set. Sources of 2D layouts are skipped.
    """
    import nibabel

    problems: list[str] = []
    warnings: list[str] = []
    for name, src in sources.items():
        if getattr(src.layout, "spatial_dims", 3) != 3:
            continue
        smaller: list[tuple[str, tuple[int, ...]]] = []
        options = dict(src.spec.preprocess)
        for rid, record in src.records.items():
            if rid in src.excluded or not record.images:
                continue
            path = record.images[0]
            try:
                img: Any = nibabel.load(str(path))
                shape = tuple(int(n) for n in img.shape[:3])
                affine = img.affine
            except Exception:  # unreadable: the layout's own check reports it
                continue
            if len(shape) < 3:
                continue
            wrong, planned = planned_shape_problem(shape, affine, options, where=f"datasets.{name}.preprocess")
            if wrong is not None:
                problems.append(f"{path}: {wrong}")
                src.excluded.add(rid)
            elif planned is not None and patch_size is not None and any(p < s for p, s in zip(planned, patch_size)):
                smaller.append((str(path), planned))
        if smaller:
            label, shape = min(smaller, key=lambda item: min(n / s for n, s in zip(item[1], patch_size or item[1])))
            warnings.append(
                f"dataset {name}: {len(smaller)} volume(s) are smaller than patch_size {list(patch_size or [])} "
                f"after preprocessing (smallest: {label}, {' x '.join(map(str, shape))}); they are padded to it "
                "(image 0, label ignored), so they train and evaluate, mostly on padding where much smaller"
            )
    return problems, warnings


def manifest_plans(
    protocol: Any, sources: Mapping[str, Any], split_manifest: str | Path | None, problems: list[str]
) -> list[Any]:
    """The session plans ``jascl data check`` checks: the dry-run selection, or those of ``split_manifest``
    (a run's ``manifest.json``, read and checked as ``jascl run --split-manifest`` reads it). A manifest that
    does not fit is one problem line; the selection is then checked instead."""
    from jascl.data.real import load_manifest, plan_sessions, plans_from_manifest
    from jascl.errors import JasclError

    if split_manifest is not None:
        try:
            manifest = load_manifest(split_manifest, protocol)
            return plans_from_manifest(manifest, protocol, sources, str(split_manifest))
        except JasclError as exc:
            problems.append(f"--split-manifest {split_manifest}: {exc}")
    return plan_sessions(protocol, sources, problems=problems, echo=lambda m: None)


def held_out_cases(plans: Sequence[Any]) -> dict[str, list[str]]:
    """Dataset -> sorted record ids of every session's test samples (``<dataset>/<id>`` references)."""
    out: dict[str, set[str]] = {}
    for plan in plans:
        for ref in plan.test:
            dataset, _, rid = str(ref).partition("/")
            out.setdefault(dataset, set()).add(rid)
    return {d: sorted(ids) for d, ids in sorted(out.items())}


def held_out_lines(held_out: Mapping[str, Sequence[str]]) -> list[str]:
    """``held out for testing:`` and one line per dataset listing its test cases (never trained on)."""
    if not held_out:
        return []
    lines = ["held out for testing (never trained on):"]
    lines += [f"  {d} ({len(ids)}): {', '.join(ids)}" for d, ids in held_out.items()]
    return lines
