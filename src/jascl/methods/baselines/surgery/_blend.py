"""CAT-SD's synthetic training data: instruments cut from labelled images, augmented, and blended onto augmented
backgrounds (Xu, Islam, Bai, Ren, IEEE TMI 2024, :mod:`.cat`).

The recipe. CAT-SD's repository (github.com/XuMengyaAmy/Synthetic_CAT_SD) keeps only the lists of its blended
training sets (``EndoInstrument_Pre/*blended*``): the new session trains on "harmonized blended" EndoVis 2018 images
plus a memory of 500 blended images of the old instruments (``generate_blended_path_add_GAN17.py``: ``N = 500``).
The blending itself is the same group's one-to-many synthesis (Wang, Islam, Xu, Ren, "Rethinking Surgical
Instrument Segmentation: A Background Image Can Be All You Need", MICCAI 2022; code
github.com/lofrienger/Single_SurgicalScene_For_Segmentation, ``data_gen/``), whose steps are followed here:

* foreground (``aug_fg.ipynb``): horizontal flip p 0.5, vertical flip p 0.2, with p 0.6 an affine map (scale
  U(0.9, 1.1) per axis, rotation U(-45, 45) degrees), with p 0.4 one of Gaussian blur (sigma U(0, 3)), mean blur
  (kernel 2..7) or median blur (kernel 3..11);
* background (``aug_bg.ipynb``): horizontal flip p 0.5, vertical flip p 0.2, each with p 0.3: brightness shift
  U(-40, 40)/255 of the intensity range, brightness factor U(0.5, 1.5), linear contrast U(0.5, 2) about the mean,
  an affine map (scale U(0.8, 1.2), rotation U(-45, 45), shear U(-20, 20) degrees, translation U(-0.2, 0.2) of the
  side, reflected border); then 0 to 2 of Gaussian blur, additive Gaussian noise (sigma U(0, 0.05) of the range)
  and pixel dropout (1-10 % of the pixels set to the minimum);
* blend (``blend_multi.ipynb``): one instrument with p 0.8, else two of different classes, pasted with their
  binary masks (hard paste) at a uniform position; the pasted pixels take the instrument's intensities and class.

Left out (stated in :mod:`.cat`): the harmonisation network CAT-SD applies after blending, the StyleGAN-XL
backgrounds of the old instruments (old cut-outs are pasted on the session's own augmented images), the
foreground crop and perspective transforms and the background's hue, sharpen, emboss and edge augmenters.

Conventions: images ``(C, *spatial)``, labels ``(*spatial)`` int64 global class ids (255 = ignore), 2D or 3D (3D
rotations and shears act in the first two spatial axes); "horizontal" is the last spatial axis of a 2D image and the
second of a volume, "vertical" the first. Every random draw comes from the ``numpy.random.Generator`` passed in.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from monai.transforms import Affine, GaussianSmooth, MedianSmooth

from jascl.protocols.schema import IGNORE_INDEX


@dataclass
class Cutout:
    """One instrument: its class, the image crop to its bounding box ``(C, *box)`` and its mask ``(*box)`` bool."""

    class_id: int
    image: torch.Tensor
    mask: torch.Tensor


def cut_instruments(image: torch.Tensor, label: torch.Tensor, classes: Sequence[int]) -> list[Cutout]:
    """One cut-out per class of ``classes`` the label shows: the image cropped to the class's bounding box, and the
    class's mask there (other pixels of the box are not part of the cut-out)."""
    out = []
    for c in classes:
        mask = label == c
        if not bool(mask.any()):
            continue
        idx = mask.nonzero()
        box = tuple(slice(int(lo), int(hi) + 1) for lo, hi in zip(idx.min(0).values, idx.max(0).values))
        out.append(Cutout(int(c), image[(slice(None), *box)].clone(), mask[box].clone()))
    return out


def _flip_axes(dims: int) -> tuple[int, int]:
    """(horizontal, vertical) spatial axes, counted from the first spatial axis."""
    return (dims - 1, 0) if dims == 2 else (1, 0)


def _flips(
    image: torch.Tensor, label: torch.Tensor, rng: np.random.Generator, p_h: float = 0.5, p_v: float = 0.2
) -> tuple[torch.Tensor, torch.Tensor]:
    horizontal, vertical = _flip_axes(label.dim())
    for axis, p in ((horizontal, p_h), (vertical, p_v)):
        if rng.random() < p:
            image, label = image.flip(axis + 1), label.flip(axis)
    return image, label


def _affine(
    image: torch.Tensor, label: torch.Tensor, padding: str, **params: object
) -> tuple[torch.Tensor, torch.Tensor]:
    """MONAI's ``Affine`` on the image (bilinear) and on the label (nearest; outside the image: ignore or 0)."""
    warp = Affine(**params, padding_mode=padding, image_only=True)  # type: ignore[arg-type]
    moved = torch.as_tensor(warp(image.float(), mode="bilinear")).as_subclass(torch.Tensor)
    fill = label.float() + 1  # 0 outside the image after the warp -> -1 below
    moved_label = torch.as_tensor(warp(fill[None], mode="nearest", padding_mode="zeros")).as_subclass(torch.Tensor)[0]
    return moved.to(image.dtype), (moved_label.round().long() - 1)


def _rotation(dims: int, degrees: float) -> list[float]:
    radians = math.radians(degrees)
    return [radians] if dims == 2 else [0.0, 0.0, radians]


def _blur(image: torch.Tensor, rng: np.random.Generator) -> torch.Tensor:
    """One of Gaussian (sigma U(0, 3)), mean (kernel 2..7) or median (kernel 3..11) blur, drawn uniformly."""
    kind = int(rng.integers(3))
    if kind == 0:
        sigma = float(rng.uniform(0.0, 3.0))
        return image if sigma < 1e-3 else torch.as_tensor(GaussianSmooth(sigma)(image)).as_subclass(torch.Tensor)
    if kind == 1:
        k = int(rng.integers(2, 8))
        dims = image.dim() - 1
        pool = F.avg_pool2d if dims == 2 else F.avg_pool3d
        pad = [(k - 1) // 2, k // 2] * dims
        padded = F.pad(image[None], pad[::-1], mode="replicate")
        return pool(padded, k, stride=1)[0]
    radius = int(rng.integers(1, 6))  # kernel 2r + 1: 3..11
    return torch.as_tensor(MedianSmooth(radius)(image)).as_subclass(torch.Tensor)


def augment_foreground(cutout: Cutout, rng: np.random.Generator) -> Cutout:
    """The foreground augmentation of the module docstring; the result is cropped to its (non-empty) mask."""
    image, mask = cutout.image.float(), cutout.mask.long()
    image, mask = _flips(image, mask, rng)
    if rng.random() < 0.6:
        dims = mask.dim()
        side = math.ceil(math.sqrt(sum(s * s for s in mask.shape)) * 1.1) + 1  # room to rotate without clipping
        pad = [p for s in reversed(mask.shape) for p in ((side - s) // 2, side - s - (side - s) // 2)]
        image, mask = F.pad(image, pad), F.pad(mask, pad)
        scale = [float(rng.uniform(0.9, 1.1)) for _ in range(dims)]
        image, mask = _affine(
            image, mask, "zeros", rotate_params=_rotation(dims, float(rng.uniform(-45, 45))), scale_params=scale
        )
        mask = (mask == 1).long()
    if rng.random() < 0.4:
        image = _blur(image, rng)
    keep = mask.bool()
    if not bool(keep.any()):  # shrunk to nothing: the cut-out as it was
        return cutout
    idx = keep.nonzero()
    box = tuple(slice(int(lo), int(hi) + 1) for lo, hi in zip(idx.min(0).values, idx.max(0).values))
    return Cutout(cutout.class_id, image[(slice(None), *box)], keep[box])


def augment_background(
    image: torch.Tensor, label: torch.Tensor, rng: np.random.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """The background augmentation of the module docstring; the label follows the geometric maps (pixels brought
    in from outside the image by the affine map are ignored, 255)."""
    image, label = _flips(image.float(), label.long(), rng)
    low, high = float(image.min()), float(image.max())
    span = max(high - low, 1e-6)
    if rng.random() < 0.3:
        image = image + float(rng.uniform(-40, 40)) / 255 * span
    if rng.random() < 0.3:
        image = image * float(rng.uniform(0.5, 1.5))
    if rng.random() < 0.3:
        mean = image.mean()
        image = (image - mean) * float(rng.uniform(0.5, 2.0)) + mean
    if rng.random() < 0.3:
        dims = label.dim()
        shear = math.tan(math.radians(float(rng.uniform(-20, 20))))
        image, label = _affine(
            image,
            label,
            "reflection",
            rotate_params=_rotation(dims, float(rng.uniform(-45, 45))),
            scale_params=[float(rng.uniform(0.8, 1.2)) for _ in range(dims)],
            shear_params=[shear] + [0.0] * (1 if dims == 2 else 5),
            translate_params=[float(rng.uniform(-0.2, 0.2)) * s for s in label.shape],
        )
        label = torch.where(label < 0, torch.full_like(label, IGNORE_INDEX), label)
    extras = rng.permutation(3)[: int(rng.integers(0, 3))]
    for kind in extras.tolist():
        if kind == 0:
            sigma = float(rng.uniform(0.0, 3.0))
            if sigma >= 1e-3:
                image = torch.as_tensor(GaussianSmooth(sigma)(image)).as_subclass(torch.Tensor)
        elif kind == 1:
            noise = torch.from_numpy(rng.standard_normal(tuple(image.shape))).float()
            image = image + noise * float(rng.uniform(0.0, 0.05)) * span
        else:
            drop = torch.from_numpy(rng.random(tuple(image.shape)) < rng.uniform(0.01, 0.1))
            image = image.masked_fill(drop, low)
    return image, label


def paste(
    image: torch.Tensor, label: torch.Tensor, cutout: Cutout, rng: np.random.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hard paste of ``cutout`` at a uniform position (cropped where it is larger than the image): the pixels of its
    mask take its intensities and its class. Returns new tensors."""
    image, label = image.clone(), label.clone()
    spatial = tuple(label.shape)
    crop = tuple(slice(0, min(b, s)) for b, s in zip(cutout.mask.shape, spatial))
    obj, mask = cutout.image[(slice(None), *crop)], cutout.mask[crop]
    offset = [int(rng.integers(0, s - b + 1)) for b, s in zip(mask.shape, spatial)]
    region = tuple(slice(o, o + b) for o, b in zip(offset, mask.shape))
    image_region = image[(slice(None), *region)]
    image_region[:, mask] = obj[:, mask].to(image.dtype)
    label[region][mask] = cutout.class_id
    return image, label


def pick_instruments(cutouts: Sequence[Cutout], rng: np.random.Generator, p_two: float = 0.2) -> list[Cutout]:
    """One cut-out drawn uniformly, and with probability ``p_two`` a second one of another class (when there is one)."""
    first = cutouts[int(rng.integers(len(cutouts)))]
    others = [c for c in cutouts if c.class_id != first.class_id]
    if others and rng.random() < p_two:
        return [first, others[int(rng.integers(len(others)))]]
    return [first]


def blend_sample(
    image: torch.Tensor, label: torch.Tensor, cutouts: Sequence[Cutout], rng: np.random.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """One synthetic sample: the background augmented, then one or two augmented instruments pasted on it."""
    image, label = augment_background(image, label, rng)
    for cutout in pick_instruments(cutouts, rng):
        image, label = paste(image, label, augment_foreground(cutout, rng), rng)
    return image, label
