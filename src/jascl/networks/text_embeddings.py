"""CLIP text embeddings of class names, from local files only (nothing is downloaded).

Methods that condition a network on the *name* of each class (the CLIP-driven universal model,
Liu et al., ICCV 2023; CLIP-CT) need one vector per class name. Two sources, both local:

* an **embeddings file**: a safetensors file whose keys are class names and whose tensors are the
  1-D vectors (all of one length ``D``), written by :func:`write_text_embeddings` or by
  ``jascl text-embeddings --weights FILE --protocol NAME --out FILE.safetensors``; read with
  :func:`load_text_embeddings`;
* a **CLIP text tower** in a local file, encoded by :func:`encode_class_names` with ``open_clip``
  (the ``clip`` extra: ``pip install open_clip_torch``). Only towers that use open_clip's bundled
  BPE tokenizer are accepted (the OpenAI and LAION CLIP models); a tower whose config names a
  Hugging Face model or tokenizer would fetch it, so it is refused.

Every error a user can fix (a missing file, a class name absent from the file, vectors of the wrong
length, an uninstalled library) is one line naming the file.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from jascl.errors import CheckpointError, ConfigError, one_line
from jascl.fileio import atomic_write

#: the prompt of Liu et al. (2023), Sec. 3.2 ("A computerized tomography of a [CLS]")
DEFAULT_TEMPLATE = "A computerized tomography of a {}."
#: open_clip's name for the config of a local CLIP folder (``local-dir:`` layout)
OPEN_CLIP_CONFIG = "open_clip_config.json"
#: metadata key of an embeddings file: the JSON list of the protocol's class names in classifier-row order
ROWS_KEY = "rows"
_SHOW = 5  # names quoted in a message


def write_text_embeddings(
    path: str | Path, mapping: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> None:
    """Write ``class name -> vector`` to a safetensors file, atomically.

    Args:
        path: the ``.safetensors`` file to write (its folder is created).
        mapping: class name -> 1-D tensor; all of one length ``D``; stored as float32.
        metadata: optional strings kept in the file's header (e.g. the CLIP weights and the template).

    Raises:
        ConfigError: an empty mapping, a vector that is not 1-D, or vectors of different lengths.
    """
    from safetensors.torch import save_file

    path = Path(path)
    if not mapping:
        raise ConfigError(f"{path}: no class embeddings to write")
    tensors: dict[str, torch.Tensor] = {}
    dims: set[int] = set()
    for name, vector in mapping.items():
        if vector.dim() != 1:
            raise ConfigError(f"{path}: the embedding of {name!r} has shape {tuple(vector.shape)}; expected (D,)")
        tensors[name] = vector.detach().to("cpu", torch.float32).contiguous()
        dims.add(vector.numel())
    if len(dims) != 1:
        raise ConfigError(f"{path}: the class embeddings have different lengths {sorted(dims)}")
    meta = {str(k): str(v) for k, v in (metadata or {}).items()}
    atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata=meta or None), suffix=".safetensors")


def load_text_embeddings(path: str | Path, names: Sequence[str], dim: int | None = None) -> torch.Tensor:
    """The embeddings of ``names``, in that order, from a file written by :func:`write_text_embeddings`.

    Args:
        path: a safetensors file keyed by class name.
        names: the class names wanted (the file may hold more).
        dim: the vector length expected (e.g. a network's text width); ``None`` accepts the file's.

    Returns:
        ``(len(names), D)`` float32 tensor on the CPU; row ``i`` is the vector of ``names[i]``.

    Raises:
        ConfigError: the file is missing or unreadable, names are absent from it, a vector is not 1-D,
            or its length is not ``dim`` (one line naming the file and the names / lengths).
    """
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise ConfigError(
            f"{path}: text embeddings file not found; write one with "
            "`jascl text-embeddings --weights CLIP_FILE --protocol NAME --out FILE.safetensors`"
        )
    try:
        with safe_open(str(path), framework="pt", device="cpu") as fh:
            keys = set(fh.keys())
            missing = [n for n in names if n not in keys]
            if missing:
                raise ConfigError(
                    f"{path}: no text embedding for {_quote(missing)} ({len(missing)} of {len(names)} names missing; "
                    f"the file holds {len(keys)} names); rewrite it with `jascl text-embeddings`"
                )
            vectors = [fh.get_tensor(n) for n in names]
    except ConfigError:
        raise
    except Exception as exc:  # safetensors raises several error types for a bad file
        raise ConfigError(f"{path}: not a readable safetensors embeddings file ({_first_line(exc)})") from None
    for name, vector in zip(names, vectors, strict=True):
        if vector.dim() != 1:
            raise ConfigError(f"{path}: the embedding of {name!r} has shape {tuple(vector.shape)}; expected (D,)")
        if dim is not None and vector.numel() != dim:
            raise ConfigError(
                f"{path}: the embedding of {name!r} has dimension {vector.numel()}, expected {dim}; "
                "write the file with the CLIP model the network was configured for"
            )
    lengths = {v.numel() for v in vectors}
    if len(lengths) > 1:
        raise ConfigError(f"{path}: the class embeddings have different dimensions {sorted(lengths)}")
    if not vectors:
        return torch.zeros(0, dim or 0)
    return torch.stack([v.to(torch.float32) for v in vectors])


def read_metadata(path: str | Path) -> dict[str, str]:
    """The string metadata of an embeddings file (``{}`` if it has none).

    Raises:
        ConfigError: the file is missing or not a safetensors file.
    """
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: text embeddings file not found")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as fh:
            return dict(fh.metadata() or {})
    except Exception as exc:  # safetensors raises several error types for a bad file
        raise ConfigError(f"{path}: not a readable safetensors embeddings file ({_first_line(exc)})") from None


def encode_class_names(
    names: Sequence[str],
    weights: str | Path,
    template: str = DEFAULT_TEMPLATE,
    *,
    model: str = "ViT-B-32",
    batch_size: int = 64,
) -> torch.Tensor:
    """Encode ``template.format(name)`` for each class name with a CLIP text tower read from local files.

    Underscores in a protocol's class names (``left_kidney``) become spaces in the prompt.
    The vectors are the text tower's projected outputs (``encode_text``), not normalised, as the
    CLIP-driven universal model uses them.

    Args:
        names: class names, in the order of the rows returned.
        weights: either a local **folder** in open_clip's ``local-dir`` layout (``open_clip_config.json``
            plus one ``.safetensors``/``.bin``/``.pth`` weights file; ``model`` is then ignored), or a local
            **weights file** (``.safetensors``/``.bin``/``.pth``/``.pt`` state dict of a whole CLIP model)
            for the built-in open_clip architecture ``model``.
        template: the prompt, with one ``{}`` for the class name.
        model: open_clip architecture of a weights file, e.g. ``ViT-B-32`` (``ViT-B-32-quickgelu`` for
            OpenAI's original weights, which use QuickGELU).
        batch_size: prompts encoded at once.

    Returns:
        ``(len(names), D)`` float32 tensor on the CPU.

    Raises:
        ConfigError: open_clip is not installed, a bad template, an unknown architecture, or a tower
            whose tokenizer or text model would be downloaded.
        CheckpointError: the weights are missing or do not fit the architecture (one line naming them).
    """
    try:
        import open_clip
    except ImportError:
        raise ConfigError(
            "encoding class names needs open_clip: install the clip extra (pip install 'jascl[clip]' "
            "or pip install open_clip_torch)"
        ) from None
    if template.count("{}") != 1:
        raise ConfigError(f"text template {template!r} must hold exactly one '{{}}' for the class name")
    weights = Path(weights)
    model_name, checkpoint, cfg = _resolve_clip(weights, model, open_clip)
    text_cfg = cfg.get("text_cfg", {})
    downloads_tokenizer = not model_name.startswith("local-dir:") and "siglip" in model_name.lower()
    if "hf_model_name" in text_cfg or "hf_tokenizer_name" in text_cfg or downloads_tokenizer:
        raise ConfigError(
            f"{weights}: CLIP architecture {model_name!r} uses a Hugging Face text model or tokenizer, which would "
            "be downloaded; use a CLIP model with open_clip's own tokenizer (e.g. ViT-B-32)"
        )
    pretrained = None if model_name.startswith("local-dir:") else str(checkpoint)  # a folder names its own file
    try:
        clip = open_clip.create_model(model_name, pretrained=pretrained, pretrained_text=False, device="cpu")
    except Exception as exc:  # torch.load / load_state_dict raise several error types
        raise CheckpointError(
            f"{checkpoint}: does not fit CLIP model {model_name!r} ({type(exc).__name__}: {_first_line(exc)}); "
            "pass the architecture the weights were trained with (--model)"
        ) from None
    tokenizer = open_clip.get_tokenizer(model_name)
    clip.eval()
    prompts = [template.format(name.replace("_", " ")) for name in names]
    rows: list[torch.Tensor] = []
    with torch.no_grad():
        for start in range(0, len(prompts), batch_size):
            tokens = tokenizer(prompts[start : start + batch_size])
            rows.append(clip.encode_text(tokens).to(torch.float32))
    if not rows:
        return torch.zeros(0, int(cfg.get("embed_dim", 0)))
    return torch.cat(rows)


def _resolve_clip(weights: Path, model: str, open_clip: Any) -> tuple[str, Path, dict[str, Any]]:
    """(open_clip model name, weights file, model config) of a local folder or weights file."""
    if weights.is_dir():
        config_file = weights / OPEN_CLIP_CONFIG
        if not config_file.is_file():
            raise CheckpointError(f"{weights}: no {OPEN_CLIP_CONFIG} in this CLIP folder (open_clip local-dir layout)")
        try:
            cfg = json.loads(config_file.read_text(encoding="utf-8"))["model_cfg"]
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{config_file}: not an open_clip config with 'model_cfg' ({exc!r})") from None
        files = sorted(p for ext in ("*.safetensors", "*.bin", "*.pth") for p in weights.glob(ext))
        if len(files) != 1:
            raise CheckpointError(
                f"{weights}: expected one CLIP weights file (.safetensors/.bin/.pth) in the folder, found {len(files)}"
            )
        return f"local-dir:{weights}", files[0], cfg
    if not weights.is_file():
        raise CheckpointError(
            f"{weights}: CLIP weights not found; pass a local weights file or open_clip folder (nothing is downloaded)"
        )
    cfg = open_clip.get_model_config(model)
    if cfg is None:
        raise ConfigError(f"unknown open_clip architecture {model!r} for {weights}; e.g. ViT-B-32, ViT-B-16, RN50")
    return model, weights, cfg


def _quote(names: Sequence[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:_SHOW])
    return shown + (f" and {len(names) - _SHOW} more" if len(names) > _SHOW else "")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return one_line(text.splitlines()[0] if text else type(exc).__name__)
