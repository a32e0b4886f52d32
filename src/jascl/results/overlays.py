"""Qualitative overlays: test samples with their ground truth and each method's prediction after a session, the
models read from the run folder's checkpoints (never trained again). Detection runs (``task: detection``) draw
boxes instead of label maps: :mod:`jascl.results.box_overlays`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jascl.errors import ConfigError
from jascl.results import plots
from jascl.results.blocks import ReportBlock, _figure, _text
from jascl.results.records import RunResults
from jascl.results.runs import RootOptions, RunInput, _load_protocol, _read_json, _session_folder, load_run_sessions


def qualitative_section(
    run: RunInput,
    prefix: str,
    samples: int,
    device: str,
    cache_dir: str | Path | None,
    echo: Callable[[str], None],
    slices: int = 1,
) -> list[ReportBlock]:
    """Overlays of a few test samples per session.

    ``slices``: of a volume, the slices shown per sample (:func:`jascl.results.plots.choose_slices`: the axial
    slice with the most ground-truth foreground first, then slices spread over the foreground's extent).

    Raises:
        JasclError, OSError, RuntimeError: the data or models cannot be loaded (``build_part`` reports it as
            this section's error).
    """
    if samples <= 0:
        return [_text("Skipped (--samples 0).")]
    folder = run.runs[0]
    note = [] if not run.multi_seed else [_text(f"Models and data of seed {run.seeds[0]} ({folder}).")]
    return note + _qualitative(
        folder, run.first, run.methods(), samples, device, cache_dir, prefix, echo, run.roots, max(1, slices)
    )


def _predict(model, image: np.ndarray, roi: Sequence[int] | None, device) -> np.ndarray:
    import torch
    from monai.inferers import sliding_window_inference

    x = torch.from_numpy(np.ascontiguousarray(image[None])).float().to(device)
    model.eval()
    with torch.no_grad():
        if roi is None or all(r >= s for r, s in zip(roi, x.shape[2:])):
            logits = model(x)
        else:
            logits = sliding_window_inference(x, list(roi), 1, model, overlap=0.25)
    return torch.as_tensor(logits).argmax(1)[0].cpu().numpy()


def run_inputs(
    run: Path,
    results: RunResults,
    device: str,
    cache_dir: str | Path | None,
    echo: Callable[[str], None],
    roots: RootOptions | None = None,
) -> tuple[Any, Any, list, Any]:
    """What the overlays of run folder ``run`` need: its protocol, its configuration (on ``device``), its
    sessions' data (checked against its ``manifest.json``) and the torch device the models run on.

    Raises:
        ConfigError: a test split that differs from the run's manifest.
    """
    import torch

    from jascl.engine.config import resolve_config

    protocol = _load_protocol(run, results)
    config = resolve_config(None, "config.yaml", run / "config.yaml")
    config.device = device
    data = load_run_sessions(run, protocol, cache_dir, roots or RootOptions(), echo=lambda msg: echo(f"[report] {msg}"))
    manifest = run / "manifest.json"
    if manifest.is_file():
        listed = {int(s["session"]): s.get("test", []) for s in _read_json(manifest).get("sessions", [])}
        for d in data:
            if listed.get(d.session.index, d.test.ids) != d.test.ids:
                raise ConfigError(f"the test split of session {d.session.index} differs from {manifest}")
    target = torch.device(
        "cuda" if device == "auto" and torch.cuda.is_available() else "cpu" if device == "auto" else device
    )
    return protocol, config, data, target


def _qualitative(
    run: Path,
    results: RunResults,
    methods: Sequence[str],
    samples: int,
    device: str,
    cache_dir: str | Path | None,
    prefix: str,
    echo: Callable[[str], None],
    roots: RootOptions | None = None,
    slices: int = 1,
) -> list[ReportBlock]:
    from jascl.engine.checkpoint import read_session_model

    protocol, config, data, target = run_inputs(run, results, device, cache_dir, echo, roots)
    if protocol.task == "detection":
        from jascl.results.box_overlays import box_qualitative

        note = [_text(f"--slices {slices}: detection images are 2D, one panel each.")] if slices > 1 else []
        return note + box_qualitative(run, results, methods, samples, protocol, config, data, target, prefix, echo)
    names = {c.id: c.name for c in protocol.classes}
    colours = plots.class_colours([c.id for c in protocol.classes])
    cache: dict[tuple[str, int], Any] = {}

    def model_after(method: str, t: int):
        if (method, t) not in cache:
            record = results.methods[method].sessions[0] if t == 0 else None
            folder = _session_folder(run, method, t, protocol.sessions[t].name, record)
            cache[(method, t)] = read_session_model(folder, protocol, config, t).to(target)
        return cache[(method, t)]

    last = {m: len(results.methods[m].sessions) - 1 for m in methods}
    blocks: list[ReportBlock] = []
    for t, session in enumerate(protocol.sessions):
        if all(t > last[m] for m in methods):
            break
        test = data[t].test
        picks = sorted(set(np.linspace(0, len(test) - 1, min(samples, len(test))).round().astype(int).tolist()))
        columns = ["input", "ground truth"]
        for m in methods:
            if t <= last[m]:
                columns.append(f"{m} after S{t}")
            if t < last[m]:
                columns.append(f"{m} after S{last[m]}")
        rows = []
        for i in picks:
            truth = np.asarray(test.labels[i])
            image = np.asarray(test.images[i][0])
            preds = {}
            for m in methods:
                for s in sorted({t, last[m]}):
                    if t <= s <= last[m]:
                        seen = np.asarray(protocol.seen_classes(s))
                        preds[f"{m} after S{s}"] = seen[
                            _predict(model_after(m, s), test.images[i], config.patch_size, target)
                        ]
            if image.ndim == 2:
                rows.append({"image": image, "label": test.ids[i], "ground truth": truth, **preds})
                continue
            codes = array_axis_codes(protocol, test.ids[i])
            for view in plots.choose_slices(truth, image.shape, codes, slices):
                rows.append(
                    {
                        "image": view.take(image),
                        "label": f"{test.ids[i]} · {view.describe()}",
                        "ground truth": view.take(truth),
                        **{column: view.take(pred) for column, pred in preds.items()},
                    }
                )
        title = f"S{t} {session.name} (domain {', '.join(session.domains)}): test samples"
        blocks.append(
            _figure(
                f"{prefix}-qualitative-s{t}",
                plots.overlay_grid(rows, columns, colours, names, title),
                f"Session {t} ({session.name}) test samples: the input, the ground truth (filled) and each method's "
                "prediction (filled) after that session and after its last one, with the ground truth outlined on "
                f"every prediction; one colour per class in every figure{_volume_note(protocol, slices)}",
            )
        )
    return blocks


def array_axis_codes(protocol, sample_id: str) -> tuple[str, str, str] | None:
    """The anatomical direction of each array axis of a preprocessed test volume, or None (synthetic volumes and
    volumes kept in their stored orientation: slices are then named by array axis).

    A volume of a public dataset is reoriented at loading to its dataset's ``preprocess.orientation``
    (default "RAS", :func:`jascl.data.medical.preprocess_volume`), so its affine's axis codes
    (:func:`jascl.results.plots.axis_codes`) are exactly those letters; sample ids are ``<dataset>/<record>``.
    """
    spec = protocol.datasets.get(sample_id.split("/", 1)[0]) if protocol.uses_datasets else None
    if spec is None:
        return None
    orientation = dict(spec.preprocess).get("orientation", "RAS")
    codes = str(orientation or "").upper()
    axes = [{"L": 0, "R": 0, "A": 1, "P": 1, "S": 2, "I": 2}.get(c) for c in codes]
    if len(codes) != 3 or None in axes or len(set(axes)) != 3:
        return None
    return (codes[0], codes[1], codes[2])


def _volume_note(protocol, slices: int) -> str:
    if protocol.spatial_dims != 3:
        return ""
    which = "the slice" if slices == 1 else f"{slices} slices: the one"
    return (
        f". Volumes: {which} with the most ground-truth foreground"
        + ("" if slices == 1 else ", then slices spread over the foreground's extent")
        + "; in the axial plane when the volume's orientation is known (shown in radiological convention: "
        "patient's right on the left, anterior up), otherwise along the last array axis, as each row's title says"
    )
