"""Atomic, code-free checkpoints (safetensors).

A checkpoint never holds pickled objects: tensors go to safetensors and the
few scalars that describe the model (backbone, classes) to its string metadata.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors import safe_open
from safetensors.torch import save_file

from jascl.engine.config import RunConfig
from jascl.errors import CheckpointError
from jascl.fileio import atomic_write
from jascl.networks.base import Segmenter, create_segmenter
from jascl.protocols.schema import Protocol

if TYPE_CHECKING:
    from jascl.networks.detector import Detector


def save_model(model: Segmenter, path: str | Path, meta: dict) -> None:
    """Write the model's state dict to ``path`` atomically (temp file + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    atomic_write(path, lambda tmp: save_file(state, str(tmp), metadata={"jascl": json.dumps(meta)}))


def read_meta(path: str | Path) -> dict:
    try:
        with safe_open(str(path), framework="pt") as f:
            return json.loads((f.metadata() or {}).get("jascl", "{}"))
    except Exception as exc:  # corrupt or not safetensors
        raise CheckpointError(
            f"{path}: not a readable jascl checkpoint ({exc}); delete it to recompute the session"
        ) from None


def check_meta(path: str | Path, meta: dict, expect: dict | None, aliases: dict | None = None) -> None:
    """Refuse a checkpoint made for another protocol, backbone, classifier or class set (one line naming both).

    ``aliases``: other values an entry may hold and still fit (:func:`session_aliases`)."""
    wanted_meta = json.loads(json.dumps(expect or {}))  # as stored: tuples become lists
    also = json.loads(json.dumps(aliases or {}))
    for key, wanted in wanted_meta.items():
        if key in meta and meta[key] != wanted and meta[key] not in also.get(key, ()):
            raise CheckpointError(
                f"{path}: made for {key} {meta[key]!r}, but this run has {key} {wanted!r}; "
                "use a new --out, or run with the settings the checkpoint was made with"
            )


def load_model(model: Segmenter, path: str | Path, expect: dict | None = None, aliases: dict | None = None) -> dict:
    """Load weights into ``model`` (whose classifier must already have the right size); returns the metadata.

    ``expect``: metadata entries the checkpoint must match (e.g. ``{"protocol": ..., "backbone": ...}``);
    ``aliases``: other values they may hold (:func:`check_meta`).
    """
    meta = read_meta(path)
    check_meta(path, meta, expect, aliases)
    with safe_open(str(path), framework="pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}
    own = model.state_dict()
    mismatched = [
        f"{k}: checkpoint {tuple(v.shape)} vs model {tuple(own[k].shape)}"
        for k, v in state.items()
        if k in own and own[k].shape != v.shape
    ]
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if mismatched or missing or unexpected:
        detail = "; ".join(
            mismatched[:3] + [f"missing {m}" for m in missing[:3]] + [f"unexpected {u}" for u in unexpected[:3]]
        )
        raise CheckpointError(f"{path}: does not fit the model ({detail}); check --backbone/--set backbone_args")
    model.load_state_dict(state)
    return meta


def session_meta(protocol: Protocol, config: RunConfig, session: int) -> dict:
    """What a session-``session`` model checkpoint of a run must match to be loaded (protocol, backbone, classes)."""
    return {
        "protocol": protocol.name,
        "backbone": config.backbone,
        "backbone_args": config.backbone_args,
        "classifier": config.classifier,
        "seen": list(protocol.seen_classes(session)),
    }


def session_aliases(protocol: Protocol, session: int) -> dict:
    """The other values a session-``session`` checkpoint's entries may hold and still fit ``protocol``: a variant's
    session 0 is that of the protocols it was made from (``Protocol.session0_of``: a K-shot, shortened or borrowing
    variant), so their base model is its base too. Later sessions fit their own protocol only."""
    return {"protocol": list(protocol.session0_of)} if session == 0 and protocol.session0_of else {}


def detector_for_run(protocol: Protocol, config: RunConfig, num_classes: int) -> Detector:
    """The detector of a detection run (``config.backbone``, :data:`jascl.networks.detector.DETECTOR_BACKBONES`) with
    ``num_classes`` rows, on the CPU; a synthetic protocol's image size sets the small detector's anchors."""
    from jascl.networks.detector import detector_for_backbone

    options = dict(config.backbone_args)
    if protocol.synthetic is not None:
        options.setdefault("image_size", int(max(protocol.synthetic.size)))
    return detector_for_backbone(
        config.backbone,
        protocol.in_channels,
        num_classes,
        cosine=config.classifier == "cosine",
        temperature=config.temperature,
        **options,
    )


def read_session_model(folder: str | Path, protocol: Protocol, config: RunConfig, session: int) -> Segmenter:
    """The model a finished session saved in ``folder``, built from the run's protocol and configuration.

    A checkpoint reader for whoever needs a trained model without training (reports, your own analysis):
    the model is on the CPU in eval mode; a checkpoint that does not fit is a one-line :class:`CheckpointError`.
    A detection protocol's session gives its detector (:func:`detector_for_run`).
    """
    if protocol.task == "detection":
        detector = detector_for_run(protocol, config, len(protocol.seen_classes(session)))
        expect, aliases = session_meta(protocol, config, session), session_aliases(protocol, session)
        load_model(detector, Path(folder) / "model.safetensors", expect, aliases)  # type: ignore[arg-type]
        return detector.eval()  # type: ignore[return-value]
    model = create_segmenter(
        config.backbone,
        protocol.spatial_dims,
        protocol.in_channels,
        len(protocol.seen_classes(session)),
        cosine=config.classifier == "cosine",
        temperature=config.temperature,
        **config.backbone_args,
    )
    load_model(
        model,
        Path(folder) / "model.safetensors",
        session_meta(protocol, config, session),
        session_aliases(protocol, session),
    )
    return model.eval()


def save_tensors(tensors: dict, path: str | Path) -> None:
    """Write named tensors (e.g. plugin state) to ``path`` atomically; nothing is written for none."""
    if not tensors:
        return
    state = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    atomic_write(path, lambda tmp: save_file(state, str(tmp)))


def load_tensors(path: str | Path) -> dict:
    """Named tensors written by :func:`save_tensors` (safetensors: no code can run)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}
    except Exception as exc:
        raise CheckpointError(
            f"{path}: not a readable safetensors file ({exc}); delete it to recompute the session"
        ) from None


# ------------------------------------------------------------------------------------------------ in-session progress

PROGRESS_FORMAT = "jascl-progress-v1"


def save_progress(path: str | Path, meta: dict, payload: dict) -> None:
    """Write an in-session checkpoint atomically: ``payload`` (nested data with tensors) as one safetensors file.

    The structure goes to the file's metadata as JSON (:func:`jascl.engine.snapshot.pack`),
    the tensors to its body; nothing is pickled.
    """
    from jascl.engine.snapshot import pack

    path = Path(path)
    tensors: dict = {}
    skeleton = pack(payload, "p", tensors)
    metadata = {"format": PROGRESS_FORMAT, "jascl": json.dumps(meta), "payload": json.dumps(skeleton)}
    atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))


def load_progress(path: str | Path, expect: dict | None = None) -> tuple[dict, dict]:
    """(metadata, payload) of an in-session checkpoint written by :func:`save_progress`."""
    from jascl.engine.snapshot import unpack

    try:
        with safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        if header.get("format") != PROGRESS_FORMAT:
            raise ValueError(f"format {header.get('format')!r}, expected {PROGRESS_FORMAT!r}")
        meta = json.loads(header["jascl"])
        payload = unpack(json.loads(header["payload"]), tensors)
    except Exception as exc:
        raise CheckpointError(
            f"{path}: not a readable jascl progress checkpoint ({exc}); delete it to restart "
            "this session from its beginning"
        ) from None
    check_meta(path, meta, expect)
    return meta, payload
