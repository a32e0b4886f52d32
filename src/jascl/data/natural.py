"""2D images (driving scenes, laparoscopy): decoding helpers shared by the 2D layouts and
the preprocessing every 2D sample goes through.

The layouts in :mod:`jascl.data.layouts` (``cityscapes``, ``idd``, ``bdd100k``,
``cholecseg8k``, ``m2caiseg``) decode files with the helpers here, so every one of
them reports missing / unreadable files, image/label size mismatches and label
values outside its table the same way. Conventions:

* images are returned as (3, H, W) float32 raw intensities in [0, 255] (RGB order);
* labels are (H, W) int64 *native* ids of the dataset; a pixel whose value or
  colour is not in the dataset's table is read as :data:`IGNORE_INDEX` (255) and
  reported by ``check()``.

:func:`preprocess_image` is the one place where 2D samples are resized and
normalised (labels always with nearest neighbour), the 2D counterpart of
``jascl.data.medical.preprocess_volume``.

This module does not import :mod:`jascl.data.layouts` at import time (the layouts
import it), hence the deferred import of :class:`~jascl.data.layouts.base.Problem`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw, UnidentifiedImageError

from jascl.errors import ConfigError, DataError
from jascl.protocols.schema import IGNORE_INDEX

if TYPE_CHECKING:
    from jascl.data.layouts.base import Problem, Record, Sample

# torchvision's ImageNet statistics, on intensities scaled to [0, 1].
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

# A label decoder: file -> ((H, W) int64 native ids with unknown pixels set to IGNORE_INDEX,
# descriptions of the unknown values / colours found, e.g. ["value 40", "colour (1, 2, 3)"]).
LabelDecoder = Callable[[Path], tuple[np.ndarray, list[str]]]

FIX_REDOWNLOAD = "re-download or re-extract this file from the dataset's release, or remove the sample"


# ---------------------------------------------------------------------------------------------
# Decoding


def open_image(path: Path) -> Image.Image:
    """Open and fully decode an image file (a truncated file fails here, not later).

    Raises:
        DataError: the file is missing or cannot be decoded (one line naming the file).
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: file is missing; {FIX_REDOWNLOAD}")
    try:
        image = Image.open(path)
        image.load()
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as error:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise DataError(f"{path}: cannot decode image ({reason}); {FIX_REDOWNLOAD}") from None
    return image


def read_rgb(path: Path) -> np.ndarray:
    """(3, H, W) float32 RGB intensities in [0, 255] of an image file (grey images are replicated)."""
    image = open_image(path)
    pixels = np.asarray(image.convert("RGB"), dtype=np.float32)
    return np.ascontiguousarray(pixels.transpose(2, 0, 1))


def read_mask_pixels(path: Path) -> np.ndarray:
    """Raw pixels of a mask file: (H, W) for single-channel / palette images (palette
    *indices*, not colours), (H, W, 3) for RGB(A) images with the alpha channel dropped."""
    image = open_image(path)
    if image.mode in ("RGB", "RGBA", "RGBX"):
        return np.asarray(image.convert("RGB"))
    if image.mode in ("L", "P", "I", "I;16", "I;16B", "I;16L", "1"):
        return np.asarray(image).astype(np.int64)
    if image.mode == "LA":
        return np.asarray(image.convert("L")).astype(np.int64)
    raise DataError(f"{path}: unsupported mask mode {image.mode!r}; expected a single-channel or RGB PNG")


def read_colour_mask(path: Path) -> np.ndarray:
    """(H, W, 3) uint8 RGB pixels of a colour mask (palette, RGBA and grey files are converted to RGB)."""
    return np.asarray(open_image(path).convert("RGB"))


def index_mask(path: Path) -> np.ndarray:
    """(H, W) int64 values of a mask that stores ids as grey levels.

    RGB files whose three channels are equal (some conversions save grey masks as RGB)
    are accepted; other RGB files are not id masks.

    Raises:
        DataError: unreadable file, or an RGB file with differing channels.
    """
    pixels = read_mask_pixels(path)
    if pixels.ndim == 3:
        if not (np.array_equal(pixels[..., 0], pixels[..., 1]) and np.array_equal(pixels[..., 0], pixels[..., 2])):
            raise DataError(
                f"{path}: expected a single-channel id mask but found a colour image; "
                "use the dataset's id masks, not its colour renderings"
            )
        pixels = pixels[..., 0]
    return pixels.astype(np.int64)


def lookup_values(values: np.ndarray, table: Mapping[int, int]) -> tuple[np.ndarray, list[str]]:
    """Map grey-level values through ``table`` (file value -> native id).

    Args:
        values: (H, W) integer values as stored in a mask file.
        table: every valid file value and the native id it stands for.

    Returns:
        (H, W) int64 native ids (unknown values -> :data:`IGNORE_INDEX`) and a sorted
        list of the unknown values, described as ``"value v"``.
    """
    present = np.unique(values)
    lut_size = int(max(int(present.max(initial=0)), max(table, default=0))) + 1
    lut = np.full(lut_size, -1, dtype=np.int64)
    for value, native in table.items():
        lut[value] = native
    # Negative values cannot occur in PNG masks; guard anyway so indexing stays valid.
    ids = lut[np.clip(values, 0, None)]
    unknown_mask = (ids < 0) | (values < 0)
    unknown = sorted(int(v) for v in np.unique(values[unknown_mask]))
    ids[unknown_mask] = IGNORE_INDEX
    return ids, [f"value {v}" for v in unknown]


def lookup_colours(
    pixels: np.ndarray, table: Mapping[tuple[int, int, int], int], tolerance: int = 0
) -> tuple[np.ndarray, list[str]]:
    """Map exact RGB colours through ``table`` (colour -> native id).

    Args:
        pixels: (H, W, 3) uint8 colour mask.
        table: every valid colour and its native id.
        tolerance: 0 (default) accepts exact colours only; t > 0 also assigns a colour
            within max-channel distance t of exactly one table colour (annotation tools
            can blend colours along boundaries).

    Returns:
        (H, W) int64 native ids (unknown colours -> :data:`IGNORE_INDEX`) and the unknown
        colours described as ``"colour (r, g, b)"`` (at most the 8 most frequent, then a count).
    """
    if pixels.ndim != 3 or pixels.shape[-1] != 3:
        raise ValueError("lookup_colours expects (H, W, 3) pixels")
    keys = (pixels[..., 0].astype(np.int64) << 16) | (pixels[..., 1].astype(np.int64) << 8) | pixels[..., 2]
    colours, inverse, counts = np.unique(keys.ravel(), return_inverse=True, return_counts=True)
    table_keys = {(r << 16) | (g << 8) | b: native for (r, g, b), native in table.items()}
    table_rgb = np.array(list(table), dtype=np.int64).reshape(-1, 3)
    table_ids = np.array(list(table.values()), dtype=np.int64)
    mapped = np.empty(len(colours), dtype=np.int64)
    unknown: list[tuple[int, int]] = []
    for index, key in enumerate(colours.tolist()):
        if key in table_keys:
            mapped[index] = table_keys[key]
            continue
        rgb = np.array([(key >> 16) & 255, (key >> 8) & 255, key & 255])
        if tolerance > 0 and len(table_rgb):
            near = np.abs(table_rgb - rgb).max(axis=1) <= tolerance
            if near.sum() == 1:
                mapped[index] = int(table_ids[near][0])
                continue
        mapped[index] = IGNORE_INDEX
        unknown.append((int(counts[index]), key))
    ids = mapped[inverse].reshape(pixels.shape[:2])
    unknown.sort(key=lambda item: (-item[0], item[1]))
    described = [f"colour ({k >> 16 & 255}, {k >> 8 & 255}, {k & 255})" for _, k in unknown[:8]]
    if len(unknown) > 8:
        described.append(f"... {len(unknown) - 8} more")
    return ids, described


def render_polygons(
    path: Path, names: Mapping[str, int], background: int = IGNORE_INDEX
) -> tuple[np.ndarray, list[str]]:
    """Rasterise a Cityscapes-style ``*_polygons.json`` annotation (Cityscapes, IDD).

    The file holds ``imgHeight``, ``imgWidth`` and a list of ``objects`` with a ``label``
    name, a ``polygon`` [[x, y], ...] and optionally ``deleted``. Objects are painted in
    file order (later ones on top), deleted objects are skipped and a ``<name>group``
    label falls back to ``<name>``, as the datasets' own conversion scripts do.

    Args:
        path: the JSON file.
        names: label name -> native id to paint (an id of :data:`IGNORE_INDEX` paints ignore).
        background: the value of pixels no polygon covers.

    Returns:
        (imgHeight, imgWidth) int64 native ids and the unknown label names (painted as ignore).

    Raises:
        DataError: the file is missing, not JSON, or lacks the size / object fields.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: file is missing; {FIX_REDOWNLOAD}")
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
        height, width = int(document["imgHeight"]), int(document["imgWidth"])
        objects = list(document["objects"])
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError) as error:
        reason = type(error).__name__ if not str(error) else str(error).splitlines()[0]
        raise DataError(f"{path}: not a polygon annotation ({reason}); {FIX_REDOWNLOAD}") from None
    # PIL's "I" mode holds any int32, so ids above 255 (none today) would still render.
    canvas = Image.new("I", (width, height), background)
    drawer = ImageDraw.Draw(canvas)
    unknown: set[str] = set()
    for item in objects:
        if not isinstance(item, dict) or item.get("deleted"):
            continue
        name = str(item.get("label", ""))
        if name not in names and name.endswith("group") and name[: -len("group")] in names:
            name = name[: -len("group")]
        value = names.get(name)
        if value is None:
            unknown.add(name)
            value = IGNORE_INDEX
        points = [tuple(float(c) for c in point[:2]) for point in item.get("polygon", [])]
        if len(points) >= 2:
            drawer.polygon(points, fill=int(value))
    return np.asarray(canvas, dtype=np.int64), [f"label name {n!r}" for n in sorted(unknown)]


def describe(items: Sequence[str], limit: int = 8) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f", ... ({len(items) - limit} more)" if len(items) > limit else "")


# ---------------------------------------------------------------------------------------------
# The parts of check() / read() that every 2D layout shares


def image_size(path: Path) -> tuple[int, int]:
    """(H, W) of an image file, after fully decoding it."""
    image = open_image(path)
    return image.height, image.width


def check_image_label(record: Record, decode_label: LabelDecoder, dataset: str, fix_values: str = "") -> list[Problem]:
    """Open a 2D record's files and report what is wrong with them.

    Reports: a missing or undecodable image or label file, a constant image (a blank frame), a label
    whose (H, W) differs from the image's, and label values / colours that are not in the dataset's table.

    Args:
        record: the record (one RGB image, optionally one label file).
        decode_label: the layout's label decoder.
        dataset: the dataset's name, for messages.
        fix_values: what to do about unknown label values.
    """
    from jascl.data.layouts.base import Problem, image_value_problems

    problems: list[Problem] = []
    size: tuple[int, int] | None = None
    for path in record.images:
        if not Path(path).is_file():
            problems.append(Problem(path, f"missing image file (sample {record.id})", FIX_REDOWNLOAD))
            continue
        try:
            size = image_size(path)
            problems += image_value_problems(path, read_rgb(Path(path)))  # a blank frame (constant) trains nothing
        except DataError as error:
            problems.append(Problem(path, _reason(error, path), FIX_REDOWNLOAD))
    if record.label is None:
        return problems
    if not Path(record.label).is_file():
        problems.append(Problem(record.label, f"missing label file (sample {record.id})", FIX_REDOWNLOAD))
        return problems
    try:
        ids, unknown = decode_label(Path(record.label))
    except DataError as error:
        problems.append(Problem(record.label, _reason(error, record.label), FIX_REDOWNLOAD))
        return problems
    if size is not None and tuple(ids.shape) != size:
        problems.append(
            Problem(
                record.label,
                f"label is {ids.shape[0]}x{ids.shape[1]} (HxW) but image {Path(record.images[0]).name} is {size[0]}x{size[1]}",
                "use the label file that belongs to this image, at the image's resolution",
            )
        )
    if unknown:
        problems.append(
            Problem(
                record.label,
                f"{dataset} label has {describe(unknown)} outside the dataset's label table",
                fix_values
                or f"regenerate the label with the dataset's own tools; those pixels are read as ignore ({IGNORE_INDEX})",
            )
        )
    return problems


def _reason(error: DataError, path: Path | str) -> str:
    """The message of a DataError about ``path`` without the path prefix and the fix suffix."""
    text = str(error)
    prefix = f"{path}: "
    text = text[len(prefix) :] if text.startswith(prefix) else text
    return text.split("; ")[0]


def read_image_label(record: Record, decode_label: LabelDecoder, meta: Mapping[str, Any] | None = None) -> Sample:
    """Decode a 2D record into a :class:`~jascl.data.layouts.base.Sample`.

    Returns:
        image (3, H, W) float32 in [0, 255]; label (H, W) int64 native ids (unknown
        values -> :data:`IGNORE_INDEX`) or None for unlabelled records; no affine.

    Raises:
        DataError: a missing / corrupt file, or image and label of different sizes.
    """
    from jascl.data.layouts.base import Sample

    if len(record.images) != 1:
        raise DataError(f"{record.id}: a 2D sample needs exactly one image file, got {len(record.images)}")
    image = read_rgb(Path(record.images[0]))
    label = None
    if record.label is not None:
        label, _ = decode_label(Path(record.label))
        if label.shape != image.shape[1:]:
            raise DataError(
                f"{record.label}: label is {label.shape[0]}x{label.shape[1]} (HxW) but image "
                f"{record.images[0]} is {image.shape[1]}x{image.shape[2]}; use the label file that "
                "belongs to this image"
            )
    return Sample(image=image, label=label, affine=None, meta={**record.meta, **(meta or {})})


def wanted_splits(options: Mapping[str, Any], known: Iterable[str], layout: str) -> set[str]:
    """The splits a layout should scan: option ``splits`` (a name or a list) or all ``known``.

    Raises:
        ConfigError: a requested split is not one of the layout's splits.
    """
    known = list(known)
    requested = options.get("splits", options.get("split"))
    if requested is None:
        return set(known)
    requested = [requested] if isinstance(requested, str) else list(requested)
    bad = [s for s in requested if s not in known]
    if bad:
        raise ConfigError(
            f"{layout} layout: unknown split(s) {', '.join(map(repr, bad))}; choose from {', '.join(known)}"
        )
    return set(requested)


def require_root(root: Path, layout: str, expected: str) -> None:
    """Raise a one-line DataError unless ``root`` is an existing folder."""
    if not root.is_dir():
        raise DataError(
            f"{root}: {layout} root does not exist; point the dataset root at the folder that holds {expected}"
        )


# ---------------------------------------------------------------------------------------------
# Preprocessing

_PREPROCESS_KEYS = {"size", "scale", "normalize"}


def preprocess_image(sample: Sample, options: Mapping[str, Any] | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """Resize and normalise a decoded 2D sample.

    Args:
        sample: image (C, H, W) float32 raw intensities in [0, 255]; label (H, W) int64 or None.
        options:
            ``size``: [h, w] output size, or ``scale``: a factor applied to (H, W) (rounded);
            not both. Images are resized bilinearly (anti-aliased when shrinking),
            labels with exact nearest neighbour so no new ids appear.
            ``normalize``: ``"imagenet"`` ((x / 255 - mean) / std with ImageNet's RGB
            statistics, for pretrained backbones), ``"zero_one"`` (x / 255) or
            ``"none"`` / absent (raw values kept).

    Returns:
        image (C, h, w) float32 and label (h, w) int64 (None if the sample has none).

    Raises:
        ConfigError: an unknown option, both ``size`` and ``scale``, a malformed size /
            scale, or ImageNet normalisation of an image without 3 channels.
    """
    options = dict(options or {})
    unknown = sorted(set(options) - _PREPROCESS_KEYS)
    if unknown:
        raise ConfigError(
            f"preprocess option(s) {', '.join(map(repr, unknown))} not known; "
            f"2D preprocessing takes {', '.join(sorted(_PREPROCESS_KEYS))}"
        )
    image = np.asarray(sample.image, dtype=np.float32)
    if image.ndim != 3:
        raise ConfigError(f"2D preprocessing needs a (C, H, W) image, got shape {tuple(image.shape)}")
    height, width = image.shape[1:]
    target = _target_size(options, height, width)

    label = None if sample.label is None else np.asarray(sample.label, dtype=np.int64)
    if target != (height, width):
        tensor = torch.from_numpy(np.ascontiguousarray(image))[None]
        shrinking = target[0] < height or target[1] < width
        image = F.interpolate(tensor, size=target, mode="bilinear", align_corners=False, antialias=shrinking)[0].numpy()
        if label is not None:
            # float32 holds every id up to 2**24 exactly; "nearest-exact" samples pixel centres.
            resized = F.interpolate(torch.from_numpy(label)[None, None].float(), size=target, mode="nearest-exact")
            label = resized[0, 0].round().long().numpy()

    mode = options.get("normalize") or "none"
    if mode == "imagenet":
        if image.shape[0] != 3:
            raise ConfigError(f"normalize: imagenet needs 3-channel RGB images, got {image.shape[0]} channel(s)")
        mean = np.asarray(IMAGENET_MEAN, dtype=np.float32)[:, None, None]
        std = np.asarray(IMAGENET_STD, dtype=np.float32)[:, None, None]
        image = (image / 255.0 - mean) / std
    elif mode == "zero_one":
        image = image / 255.0
    elif mode != "none":
        raise ConfigError(f"normalize: {mode!r} is not known; use imagenet, zero_one or none")
    return np.ascontiguousarray(image, dtype=np.float32), label


def _target_size(options: Mapping[str, Any], height: int, width: int) -> tuple[int, int]:
    if "size" in options and "scale" in options:
        raise ConfigError("preprocess: give either size or scale, not both")
    if options.get("size") is not None:
        size = options["size"]
        if isinstance(size, int):
            size = [size, size]
        try:
            h, w = (int(v) for v in size)
        except (TypeError, ValueError):
            raise ConfigError(f"preprocess size must be [height, width], got {size!r}") from None
        if h <= 0 or w <= 0:
            raise ConfigError(f"preprocess size must be positive, got {size!r}")
        return h, w
    if options.get("scale") is not None:
        try:
            scale = float(options["scale"])
        except (TypeError, ValueError):
            raise ConfigError(f"preprocess scale must be a number, got {options['scale']!r}") from None
        if scale <= 0:
            raise ConfigError(f"preprocess scale must be positive, got {scale}")
        return max(1, int(round(height * scale))), max(1, int(round(width * scale)))
    return height, width
