"""Qualitative overlays: test samples with their ground truth and each method's prediction after a session, the
models read from the run folder's checkpoints (never trained again)."""

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
    run: RunInput, prefix: str, samples: int, device: str, cache_dir: str | Path | None, echo: Callable[[str], None]
) -> list[ReportBlock]:
    """Overlays of a few test samples per session.

    Raises:
        JasclError, OSError, RuntimeError: the data or models cannot be loaded (``build_part`` reports it as
            this section's error).
    """
    if samples <= 0:
        return [_text("Skipped (--samples 0).")]
    folder = run.runs[0]
    note = [] if not run.multi_seed else [_text(f"Models and data of seed {run.seeds[0]} ({folder}).")]
    return note + _qualitative(folder, run.first, run.methods(), samples, device, cache_dir, prefix, echo, run.roots)


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
) -> list[ReportBlock]:
    import torch

    from jascl.engine.checkpoint import read_session_model
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
    names = {c.id: c.name for c in protocol.classes}
    colours = plots.class_colours([c.id for c in protocol.classes])
    target = torch.device(
        "cuda" if device == "auto" and torch.cuda.is_available() else "cpu" if device == "auto" else device
    )
    cache: dict[tuple[str, int], Any] = {}

    def model_after(method: str, t: int):
        if (method, t) not in cache:
            folder = _session_folder(run, method, t, protocol.sessions[t].name)
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
            truth = test.labels[i]
            image, where = plots.display_slice(test.images[i][0], truth)
            row: dict[str, Any] = {
                "image": image,
                "label": f"{test.ids[i]} {where}".strip(),
                "ground truth": plots.display_slice(truth, truth)[0],
            }
            for m in methods:
                for s in sorted({t, last[m]}):
                    if s < t or s > last[m]:
                        continue
                    seen = np.asarray(protocol.seen_classes(s))
                    pred = seen[_predict(model_after(m, s), test.images[i], config.patch_size, target)]
                    row[f"{m} after S{s}"] = plots.display_slice(pred, truth)[0]
            rows.append(row)
        title = f"S{t} {session.name} (domain {', '.join(session.domains)}): test samples"
        what = "input (the slice of the volume with the most foreground)" if protocol.spatial_dims == 3 else "input"
        blocks.append(
            _figure(
                f"{prefix}-qualitative-s{t}",
                plots.overlay_grid(rows, columns, colours, names, title),
                f"Session {t} ({session.name}) test samples: {what}, ground truth, and each method's "
                "prediction after that session and after its last one",
            )
        )
    return blocks
