"""Loading a torchvision Faster R-CNN state dict into a :class:`~jascl.networks.detector.Detector` by name
(``--weights`` of a detection run): legacy names mapped, wrapper prefixes dropped, the box predictor never loaded.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from jascl.errors import CheckpointError, ConfigError
from jascl.networks.weights import read_state_dict

__all__ = ["PREDICTOR_PREFIX", "load_detector_weights"]

#: what the predictor's state-dict names start with (never loaded from a file: its class count differs)
PREDICTOR_PREFIX = "roi_heads.box_predictor."


# torchvision's pre-0.13 names (e.g. its fasterrcnn_resnet50_fpn_coco-258fb6c6.pth) -> today's; torchvision maps them
# through state-dict version metadata, which a tensor-by-tensor load (or a .safetensors file) does not carry
_LEGACY_NAMES = (
    (re.compile(r"^(backbone\.fpn\.(?:inner|layer)_blocks\.\d+)\.(weight|bias)$"), r"\1.0.\2"),
    (re.compile(r"^(rpn\.head\.conv)\.(weight|bias)$"), r"\1.0.0.\2"),
)
_WRAPPER_PREFIXES = ("module.", "model.", "detector.")


def _candidate_names(name: str) -> list[str]:
    names = [name]
    for pattern, replacement in _LEGACY_NAMES:
        if pattern.match(name):
            names.append(pattern.sub(replacement, name))
    return names


@torch.no_grad()
def load_detector_weights(model: nn.Module, path: str | Path) -> dict:
    """Load a local torchvision Faster R-CNN state dict (``.pth``/``.pt``/``.bin`` or ``.safetensors``) by name.

    Every tensor whose (torchvision) name and shape match a tensor of ``model`` is copied, except the box predictor's
    (``roi_heads.box_predictor.*``: its class count differs); torchvision's pre-0.13 FPN / RPN-head names are mapped
    to today's, and a ``module.`` / ``model.`` prefix on every key is dropped.

    Returns:
        ``{"loaded": number of tensors copied, "skipped": file keys not loaded (the predictor's, unknown names,
        other shapes), "missing": model tensors left as they were}``.

    Raises:
        ConfigError: one line naming the file: missing, unreadable, not a state dict, or nothing matching.
    """
    try:
        tensors = read_state_dict(path)
    except CheckpointError as exc:
        raise ConfigError(f"{exc} (detector weights: a torchvision Faster R-CNN state dict)") from None
    for prefix in _WRAPPER_PREFIXES:
        if all(k.startswith(prefix) for k in tensors):
            tensors = {k[len(prefix) :]: v for k, v in tensors.items()}
    own = model.state_dict(keep_vars=True)
    loaded: set[str] = set()
    skipped: list[str] = []
    for key, tensor in tensors.items():
        target = next(
            (n for n in _candidate_names(key) if n in own and tuple(own[n].shape) == tuple(tensor.shape)), None
        )
        if key.startswith(PREDICTOR_PREFIX) or target is None or target in loaded:
            skipped.append(key)
            continue
        own[target].data.copy_(tensor)
        loaded.add(target)
    if not loaded:
        example = next(iter(tensors))
        raise ConfigError(
            f"{path}: no tensor matches the {getattr(model, 'variant', '')} detector (the file has e.g. {example!r}); pass a "
            "torchvision Faster R-CNN state dict of the same architecture (fasterrcnn_resnet50_fpn for resnet50-fpn)"
        )
    missing = [n for n in own if n not in loaded and not n.startswith(PREDICTOR_PREFIX)]
    return {"loaded": len(loaded), "skipped": skipped, "missing": missing}
