"""Which domain a test input comes from, when the evaluation does not say: the nearest domain statistics.

A method with per-domain parameters (MDIL) must pick a branch for every test input. The paper's setting gives
no test-time domain label, so by default the branch is inferred from the input itself: each domain keeps the
intensity statistics of its labelled training images, per input channel the mean and the standard deviation
over the voxels (:func:`input_statistics`), and a test batch goes to the domain whose statistics are nearest
(Euclidean) to its own (:func:`batch_statistics`, :func:`nearest_domain`). On the benchmarks the domains are
scanners and modalities (CT windows, MRI, ultrasound-like speckle), whose intensity statistics differ
strongly; within a domain, images of one scanner share them.

Conventions: images are (C, *S) arrays or tensors, batches (B, C, *S); a statistics vector is (2C,):
``[mean_1 .. mean_C, std_1 .. std_C]`` in the image's own intensity units.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

#: images of a session read to compute its domain statistics (the first ones of its labelled split)
STAT_SAMPLES = 8


def input_statistics(images: Sequence[Any], limit: int = STAT_SAMPLES) -> torch.Tensor:
    """(2C,) mean of the per-image channel means and of the per-image channel standard deviations of the first
    ``limit`` images (each (C, *S)).

    Raises:
        ValueError: no image.
    """
    stats = []
    for i in range(min(limit, len(images))):
        x = torch.as_tensor(np.asarray(images[i]), dtype=torch.float32)
        flat = x.reshape(x.shape[0], -1)
        stats.append(torch.cat([flat.mean(dim=1), flat.std(dim=1, unbiased=False)]))
    if not stats:
        raise ValueError("no image to compute domain statistics from")
    return torch.stack(stats).mean(dim=0)


def batch_statistics(x: torch.Tensor) -> torch.Tensor:
    """(2C,) statistics of a batch (B, C, *S): the mean over its images of each image's channel means and stds."""
    flat = x.detach().float().reshape(x.shape[0], x.shape[1], -1)
    return torch.cat([flat.mean(dim=2).mean(dim=0), flat.std(dim=2, unbiased=False).mean(dim=0)])


def nearest_domain(stats: torch.Tensor, domains: Mapping[str, torch.Tensor]) -> str:
    """The domain whose statistics are nearest to ``stats`` (Euclidean; ties: the first name in sorted order).

    Raises:
        ValueError: no domain.
    """
    if not domains:
        raise ValueError("no domain statistics to compare with")
    names = sorted(domains)
    distances = [float(torch.linalg.vector_norm(stats.cpu() - domains[n].cpu())) for n in names]
    return names[int(np.argmin(distances))]
