"""``reseed``: MONAI's ``set_random_state(seed=...)``, draw for draw, without building new random states."""

import numpy as np
import pytest
import torch
from monai.transforms import Compose, RandAdjustContrast, RandFlipd, RandGaussianNoise, RandSpatialCropd

from jascl.data.datasets import reseed


def _pipeline() -> Compose:
    return Compose(
        [
            RandSpatialCropd(keys=["image", "label"], roi_size=[5, 6], random_size=False),
            *(RandFlipd(keys=["image", "label"], prob=0.5, spatial_axis=axis) for axis in range(2)),
        ]
    )


@pytest.mark.parametrize("seed", [0, 1, 7, 2**32 - 1, 123456789])
def test_reseeded_pipeline_draws_what_set_random_state_draws(seed):
    data = {"image": torch.arange(80.0).reshape(1, 8, 10), "label": torch.arange(80).reshape(1, 8, 10)}
    reference, reused = _pipeline(), _pipeline()
    reseed(reused, 3)  # reseeding a pipeline that already holds states from an earlier seed
    reused(data)
    reference.set_random_state(seed=seed)
    reseed(reused, seed)
    for _ in range(3):  # the same stream of draws, not only the first
        a, b = reference(data), reused(data)
        assert torch.equal(a["image"], b["image"]) and torch.equal(a["label"], b["label"])


def test_reseed_reuses_the_states_and_never_seeds_monais_shared_class_state():
    shared = RandFlipd.R  # the class attribute every MONAI transform reads until it is seeded
    before = shared.get_state()[1].copy()
    flips = [RandFlipd(keys=["image"], prob=0.5, spatial_axis=a) for a in range(2)]
    intensity = Compose([RandAdjustContrast(prob=1.0), RandGaussianNoise(prob=1.0)])
    pipeline = Compose([*flips, intensity])
    reseed(pipeline, 11)  # first time: own states are built
    states = [pipeline.R, flips[0].R, flips[1].R, intensity.R, *(t.R for t in intensity.transforms)]
    assert all(s is not shared for s in states)
    reseed(pipeline, 12)  # later: the same objects, reseeded
    assert [pipeline.R, flips[0].R, flips[1].R, intensity.R, *(t.R for t in intensity.transforms)] == states
    assert np.array_equal(shared.get_state()[1], before)
    # the nested Compose's children got the seeds MONAI's recursion gives them
    expected = Compose(
        [RandFlipd(keys=["image"], prob=0.5, spatial_axis=a) for a in range(2)]
        + [Compose([RandAdjustContrast(prob=1.0), RandGaussianNoise(prob=1.0)])]
    ).set_random_state(seed=12)
    got = [t.R.randint(1000, size=4).tolist() for t in intensity.transforms]
    want = [t.R.randint(1000, size=4).tolist() for t in expected.transforms[2].transforms]
    assert got == want
