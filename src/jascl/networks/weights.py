"""Pretrained backbone weights from local files (never downloaded).

Accepted files: ``.safetensors`` (read with safetensors) and ``.pth``/``.pt``/
``.bin`` (read with ``torch.load(..., weights_only=True)``, which refuses
pickles that would run code). Common wrappers (``{"state_dict": ...}``,
``{"model": ...}``, ``{"module": ...}``) are unwrapped and common key prefixes
(``module.``, ``backbone.``, ``model.``, ``encoder.``, ``image_encoder.``) are
stripped when that makes the keys fit the backbone. Any mismatch is a
:class:`~jascl.errors.CheckpointError` with one line naming the file, the first
offending keys and shapes, and the input-channel mismatch in words.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch
from torch import nn

from jascl.errors import CheckpointError

WRAPPER_KEYS = ("state_dict", "model", "module", "model_state", "network", "net")
PREFIXES = ("module.", "backbone.", "model.", "encoder.", "image_encoder.", "net.")
_SHOW = 3  # mismatching keys named in the message


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of a weights file, unwrapped from a common wrapper dict.

    Raises:
        CheckpointError: missing file, unknown extension, unreadable file, a
            pickle that needs code execution, or no tensors inside.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: weights file not found; pass a local .safetensors/.pth/.pt/.bin file")
    suffix = path.suffix.lower()
    data: Any  # a state dict, possibly nested in wrappers
    if suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            data = load_file(str(path), device="cpu")
        except Exception as exc:  # safetensors raises several error types for bad files
            raise CheckpointError(f"{path}: not a readable safetensors file ({_first_line(exc)})") from None
    elif suffix in (".pth", ".pt", ".bin"):
        try:
            data = torch.load(str(path), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            raise CheckpointError(
                f"{path}: not a plain tensor file (the pickle needs code execution, refused: "
                f"{_first_line(exc)}); convert it to .safetensors in a trusted environment"
            ) from None
        except Exception as exc:
            raise CheckpointError(f"{path}: cannot read weights ({type(exc).__name__}: {_first_line(exc)})") from None
    else:
        raise CheckpointError(f"{path}: unknown weights format {suffix!r}; use .safetensors, .pth, .pt or .bin")
    for _ in range(3):  # nested wrappers such as {"model": {"state_dict": ...}}
        if isinstance(data, dict) and not _has_tensors(data):
            inner = next((data[k] for k in WRAPPER_KEYS if isinstance(data.get(k), dict)), None)
            if inner is None:
                break
            data = inner
    if not isinstance(data, dict) or not _has_tensors(data):
        raise CheckpointError(
            f"{path}: no tensors found (expected a state dict, optionally under {'/'.join(WRAPPER_KEYS)})"
        )
    return {k: v for k, v in data.items() if isinstance(v, torch.Tensor)}


def load_backbone_weights(backbone: nn.Module, path: str | Path, strict: bool = True) -> list[str]:
    """Load a local weights file into ``backbone`` (in place).

    Args:
        backbone: the module to fill (a :class:`~jascl.networks.base.Backbone`).
        path: ``.safetensors``, ``.pth``, ``.pt`` or ``.bin`` file.
        strict: every backbone key must be in the file and vice versa; when
            False, keys missing on either side are allowed (returned), but a
            shape mismatch on a shared key is still an error. Keys under the backbone's
            ``ignored_weight_prefixes`` (parts it replaced) are skipped either way.

    Returns:
        Backbone keys left at their current values (empty when strict).

    Raises:
        CheckpointError: one line naming the file and the first mismatching keys/shapes.
    """
    path = Path(path)
    state = read_state_dict(path)
    expected = {k: v.shape for k, v in backbone.state_dict().items()}
    state = _strip_prefixes(state, expected)
    ignored = tuple(getattr(backbone, "ignored_weight_prefixes", ()))
    state = {k: v for k, v in state.items() if not k.startswith(ignored)} if ignored else state
    shape_errors = [k for k in state if k in expected and tuple(state[k].shape) != tuple(expected[k])]
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    problems = []
    if shape_errors:
        channel = _in_channel_mismatch(backbone, state, shape_errors)
        if channel:
            problems.append(channel)
        problems.append(
            "shape mismatch "
            + ", ".join(f"{k}: model {list(expected[k])} vs file {list(state[k].shape)}" for k in shape_errors[:_SHOW])
            + _more(shape_errors)
        )
    if strict and missing:
        problems.append(
            "missing in file " + ", ".join(f"{k} {list(expected[k])}" for k in missing[:_SHOW]) + _more(missing)
        )
    if strict and unexpected:
        problems.append(
            "not in model " + ", ".join(f"{k} {list(state[k].shape)}" for k in unexpected[:_SHOW]) + _more(unexpected)
        )
    if problems:
        hint = "; pass strict=False to load a subset" if strict and not shape_errors else ""
        raise CheckpointError(f"{path}: weights do not fit {type(backbone).__name__}: " + "; ".join(problems) + hint)
    backbone.load_state_dict(state, strict=False)
    return missing


def _has_tensors(d: dict) -> bool:
    return any(isinstance(v, torch.Tensor) for v in d.values())


def _strip_prefixes(state: dict[str, torch.Tensor], expected: dict) -> dict[str, torch.Tensor]:
    """Rename the file's keys to fit the model's, if a common prefix is in the way.

    Candidates: the keys as they are; the keys under one of :data:`PREFIXES`
    with that prefix removed (up to three levels, other keys dropped -- e.g. the
    ``image_encoder.*`` part of a full SAM checkpoint); each of those with one
    of the model's own top-level prefixes added (a bare encoder file loaded into
    ``encoder.*``). The candidate matching most model keys wins; ties keep the
    least renamed one.
    """
    candidates, frontier = [state], [state]
    for _ in range(3):
        frontier = [
            {k[len(p) :]: v for k, v in s.items() if k.startswith(p)}
            for s in frontier
            for p in PREFIXES
            if any(k.startswith(p) for k in s)
        ]
        candidates += frontier
    tops = sorted({k.split(".", 1)[0] + "." for k in expected if "." in k})
    candidates += [{t + k: v for k, v in c.items()} for c in list(candidates) for t in tops]
    return max(candidates, key=lambda c: sum(k in expected for k in c))


def _in_channel_mismatch(backbone: nn.Module, state: dict, shape_errors: list[str]) -> str | None:
    """'first conv expects 1 input channels, file has 3' when the first conv's in-channels differ."""
    for name, module in backbone.named_modules():
        if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            key = f"{name}.weight"
            if key in shape_errors:
                model_in, file_in = module.weight.shape[1] * module.groups, state[key].shape[1] * module.groups
                if model_in != file_in and module.weight.shape[2:] == state[key].shape[2:]:
                    return f"first conv ({key}) expects {model_in} input channels, file has {file_in}"
            return None  # only the first conv decides the input channels
    return None


def _more(keys: list[str]) -> str:
    return f" (+{len(keys) - _SHOW} more)" if len(keys) > _SHOW else ""


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__
