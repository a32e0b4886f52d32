"""The prototype passes of a reused session, kept in its folder for the next method that reuses it.

When a run reuses a finished session (a shared session-0 base, or a session of an interrupted run), the loop
fires ``session_restored``, and plugins that keep prototypes compute them again from the restored model: a pass
over the session's whole labelled samples (:meth:`jascl.engine.tasks.Task.compute_prototype_requests`). Every
JASCL variant of a study restores the same keyed base, so each made the same pass over the whole base set, at
the paper's scale a forward of every base volume. This module keeps each answer in the session's folder
(``prototype-cache/<key>.safetensors``), so the pass is made once per base; and the run that trains a shared
base answers the calls its sharers' restores will make (:meth:`jascl.engine.plugin.Plugin.restore_requests`) in
the base session's own pass (:func:`keep`), so a restore of a base trained in this version makes none.

An answer is served only to the same question asked of the same model in the same setting. The key hashes:

* the request (:class:`jascl.engine.prototypes.PrototypeRequest`: classes and options);
* the model's weights and buffers as they are when asked (not the file they were loaded from, so a plugin
  that changed them in ``session_restored`` gets its own answer);
* the session (index, sample ids, the classes it teaches and the others);
* the sliding windows of volumes larger than the patch (patch, overlap, windows per forward);
* what changes a pass's float sums: device type, autocast dtype, batch size, process count, and on a CPU the
  thread count;
* the cache format (:data:`CACHE_VERSION`) and jascl's version. Change :data:`CACHE_VERSION` with any change of
  what a pass computes.

An answer from the cache is therefore the tensor the pass would give here. With several processes every rank
computes unless every rank found every answer: the ranks agree with one all-reduce, because the pass itself is
collective. Rank 0 writes (atomically: a killed write leaves no file; two jobs writing the same answer write the
same bytes). A file that cannot be read is computed again and rewritten; a folder that cannot be written to (a
read-only shared base) only costs the next restore its pass.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from jascl import __version__, distributed
from jascl.engine.checkpoint import load_tensors, save_tensors
from jascl.engine.prototypes import PrototypeRequest
from jascl.protocols.schema import SessionSpec

if TYPE_CHECKING:
    from jascl.engine.config import RunConfig

log = logging.getLogger("jascl")

#: bump when what a prototype pass computes changes (an older file is then a miss, never misread)
# 2: volumes larger than the patch through sliding windows (accumulate_prototypes); 3: volumes whose
# stitched features exceed PROTOTYPE_BLOCK_ELEMENTS taken in blocks (the same prototypes, summed in another order)
CACHE_VERSION = 3

#: the cache's folder inside a session folder
FOLDER = "prototype-cache"

Results = dict[int, torch.Tensor]


def model_digest(model: nn.Module) -> str:
    """A hash of every weight and buffer of ``model`` (names, dtypes, shapes and bytes)."""
    h = hashlib.blake2b(digest_size=20)
    for name, tensor in model.state_dict().items():
        t = tensor.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())  # (reshape: 0-d counters, e.g. BatchNorm's)
    return h.hexdigest()


def request_key(request: PrototypeRequest, setting: dict[str, Any]) -> str:
    """The file name stem of ``request``'s answer in ``setting`` (model digest, session, pass options)."""
    text = json.dumps({"request": dataclasses.asdict(request), **setting}, sort_keys=True)
    return hashlib.blake2b(text.encode(), digest_size=20).hexdigest()


def _read(path: Path) -> Results | None:
    if not path.exists():
        return None
    try:
        tensors = load_tensors(path)
        classes = tensors.pop("classes").tolist()
        return {int(c): tensors[f"c{c}"] for c in classes}
    except Exception:  # a damaged file: computed again and rewritten
        log.warning("%s: unreadable prototype cache entry; computing it again", path)
        return None


def _write(path: Path, result: Results) -> None:
    tensors = {f"c{c}": v for c, v in result.items()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_tensors({"classes": torch.tensor(sorted(result), dtype=torch.int64), **tensors}, path)
    except OSError as exc:  # a read-only or full disk costs the next restore its pass, not this run
        log.warning("%s: the prototype cache entry was not written (%s)", path, exc)


def pass_setting(
    t: int, ids: Sequence[str], session: SessionSpec, device: torch.device, amp: torch.dtype | None, config: RunConfig
) -> dict[str, Any]:
    """What decides a pass over session ``t``'s labelled samples besides the request and the model: the session
    (its index, sample ids, taught classes and how it labels the others), the sliding windows of samples larger
    than the patch, and what orders the float sums."""
    return {
        "windows": [config.patch_size, config.sw_overlap, config.sw_batch_size],
        "session": t,
        "samples": hashlib.blake2b("\n".join(ids).encode(), digest_size=20).hexdigest(),
        "classes": list(session.classes),
        "others": str(session.other_classes),
        "device": device.type,
        "amp": str(amp),
        "batch_size": config.batch_size,
        "world": distributed.world_size(),
        "threads": torch.get_num_threads() if device.type == "cpu" else 0,
    }


def _paths(folder: Path, requests: Sequence[PrototypeRequest], setting: dict[str, Any], model: nn.Module) -> list[Path]:
    """The cache files of ``requests`` asked of ``model`` in ``setting`` (:func:`pass_setting`)."""
    setting = {**setting, "model": model_digest(model), "cache": CACHE_VERSION, "jascl": __version__}
    return [folder / FOLDER / f"{request_key(r, setting)}.safetensors" for r in requests]


def keep(
    folder: Path,
    requests: Sequence[PrototypeRequest],
    results: Sequence[Results],
    setting: dict[str, Any],
    model: nn.Module,
) -> None:
    """Write the answers to ``requests``, computed from ``model`` by the pass of the session that trains into
    ``folder``, for the restores of that session to come (:meth:`jascl.engine.plugin.Plugin.restore_requests`):
    the files :func:`serve` will look for when it is asked the same of the same weights (rank 0 writes)."""
    if distributed.is_main():
        for path, result in zip(_paths(folder, requests, setting, model), results):
            _write(path, result)


def serve(
    folder: Path,
    requests: Sequence[PrototypeRequest],
    setting: dict[str, Any],
    model: nn.Module,
    compute: Callable[[list[PrototypeRequest]], list[Results]],
) -> list[Results]:
    """The answers to ``requests`` (distinct), read from ``folder``'s cache where every rank has them all, else
    computed by ``compute`` in one pass (every rank) and written (rank 0).

    ``setting``: what besides the request and the model decides the answer (see the module docstring).
    """
    paths = _paths(folder, requests, setting, model)
    found = [_read(p) for p in paths]
    # the pass is collective: every rank computes unless every rank has every answer
    missing = distributed.all_reduce_sum(torch.tensor([float(sum(f is None for f in found))])).item()
    if missing == 0:
        return [f for f in found if f is not None]
    results = compute(list(requests))
    if distributed.is_main():
        for path, result in zip(paths, results):
            _write(path, result)
    return results
