"""Boundary-aware degradation of unlabelled data (paper, limitations: "Noisy Unlabeled Data").

Sobel gradients of the image give a boundary map, normalised and smoothed into
a soft mask B in [0, 1]; blur, a contrast change and additive Gaussian noise
are applied, weighted by B, so structure boundaries are degraded and
homogeneous regions stay almost untouched:

    x' = B * (contrast(blur(x)) + noise) + (1 - B) * x

applied to 70% of the unlabelled samples. Schedules (the paper's table):

=========== =================== ============= ===============
schedule    blur sigma          contrast      noise sigma
=========== =================== ============= ===============
moderate    U[0.5, 1.5]         1 +- 0.15     0.02
heavy       U[1.0, 2.5]         1 +- 0.30     0.05
=========== =================== ============= ===============
"""

from __future__ import annotations

import numpy as np
import torch
from monai.transforms import GaussianSmooth, SobelGradients

from jascl.data.types import LazySequence, Split

SCHEDULES: dict[str, dict] = {
    "moderate": {"blur": (0.5, 1.5), "contrast": 0.15, "noise": 0.02},
    "heavy": {"blur": (1.0, 2.5), "contrast": 0.30, "noise": 0.05},
}
DEGRADED_FRACTION = 0.7


def boundary_mask(image: torch.Tensor) -> torch.Tensor:
    """Soft boundary mask in [0, 1] of a (C, *spatial) image: smoothed, normalised Sobel magnitude."""
    grey = image.float().mean(0, keepdim=True)
    grads = torch.as_tensor(SobelGradients(kernel_size=3)(grey))
    magnitude = grads.pow(2).sum(0, keepdim=True).sqrt()
    soft = torch.as_tensor(GaussianSmooth(sigma=1.0)(magnitude))[0]
    peak = soft.max()
    return (soft / peak).clamp(0, 1) if peak > 0 else torch.zeros_like(soft)


def degrade(image: torch.Tensor, rng: np.random.Generator, schedule: str) -> torch.Tensor:
    """Boundary-weighted blur + contrast + Gaussian noise of one (C, *spatial) image."""
    s = SCHEDULES[schedule]
    image = image.float()
    mask = boundary_mask(image)[None]
    blurred = torch.as_tensor(GaussianSmooth(sigma=float(rng.uniform(*s["blur"])))(image))
    factor = float(rng.uniform(1 - s["contrast"], 1 + s["contrast"]))
    mean = blurred.mean()
    damaged = (blurred - mean) * factor + mean
    damaged = damaged + torch.from_numpy(rng.normal(0.0, s["noise"], size=tuple(image.shape))).float()
    return mask * damaged + (1 - mask) * image


def degrade_pool(split: Split, schedule: str, seed: int, fraction: float = DEGRADED_FRACTION) -> Split:
    """A copy of an unlabelled split with ``fraction`` of its samples degraded (seeded choice)."""
    if schedule == "none" or len(split) == 0:
        return split
    rng = np.random.default_rng([seed, 4099])
    chosen = rng.choice(len(split), size=int(round(fraction * len(split))), replace=False)
    images = split.images.copy()
    for i in sorted(chosen):
        images[i] = degrade(torch.from_numpy(images[i]), rng, schedule).numpy()
    return Split(images, split.labels, split.ids)


class DegradedSamples(LazySequence):
    """A lazy split's images with the noise schedule applied to a seeded ``fraction`` of them, sample by sample.

    For protocols on datasets, whose unlabelled pools are read lazily (never held in memory as one
    array): sample ``i``, when chosen, is degraded with its own generator seeded by ``(seed, i)``, so
    the result does not depend on the order samples are read in. (The synthetic pools use
    :func:`degrade_pool`, one generator over the pool, as before.) Indexing, slicing, ``len``,
    ``shape``, ``ndim`` and ``dtype`` behave like the wrapped images.
    """

    def __init__(self, images, schedule: str, seed: int, fraction: float = DEGRADED_FRACTION) -> None:
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown noise schedule {schedule!r}; one of {', '.join(SCHEDULES)}")
        self.images = images
        self.schedule = schedule
        self.seed = seed
        n = len(images)
        rng = np.random.default_rng([seed, 4099])
        self.chosen = frozenset(int(i) for i in rng.choice(n, size=int(round(fraction * n)), replace=False))
        self.shape = images.shape
        self.ndim = images.ndim
        self.dtype = np.dtype(np.float32)

    def __len__(self) -> int:
        return len(self.images)

    def _one(self, i: int) -> np.ndarray:
        image = np.asarray(self.images[i], dtype=np.float32)
        if i not in self.chosen:
            return image
        rng = np.random.default_rng([self.seed, 4099, i])
        return degrade(torch.from_numpy(image), rng, self.schedule).numpy()


def degrade_lazy_pool(split: Split, schedule: str, seed: int) -> Split:
    """``split`` (a lazy unlabelled pool of a dataset protocol) with its images degraded on access."""
    if schedule == "none" or len(split) == 0:
        return split
    return Split(DegradedSamples(split.images, schedule, seed), split.labels, split.ids)  # type: ignore[arg-type]
