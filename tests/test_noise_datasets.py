"""The paper's noisy unlabelled pools on protocols over datasets: degraded on access, the same 70 % whatever the
order samples are read in."""

from __future__ import annotations

import numpy as np
import torch

from jascl.data.noise import DegradedSamples, degrade
from jascl.data.sessions import load_sessions
from jascl.protocols import parse_protocol
from test_real_protocols import FAKE, fake_protocol, write_fake


def test_degraded_samples_choose_seventy_percent_and_do_not_depend_on_read_order():
    rng = np.random.default_rng(0)
    images = rng.random((10, 1, 12, 12)).astype(np.float32)
    lazy = DegradedSamples(images, "heavy", seed=3)
    assert len(lazy.chosen) == 7 and lazy.shape == images.shape and lazy.ndim == 4
    forward = [lazy[i] for i in range(10)]
    backward = [lazy[i] for i in reversed(range(10))][::-1]
    for i in range(10):
        assert np.array_equal(forward[i], backward[i])  # each sample has its own generator
        assert np.array_equal(forward[i], images[i]) == (i not in lazy.chosen)
    i = min(lazy.chosen)  # by hand: the same degradation with the sample's own generator
    expected = degrade(torch.from_numpy(images[i]), np.random.default_rng([3, 4099, i]), "heavy").numpy()
    assert np.array_equal(lazy[i], expected)
    assert lazy[0:3].shape == (3, 1, 12, 12) and np.array_equal(lazy[-1], lazy[9])


def test_dataset_protocol_pool_is_degraded_and_labelled_data_is_not(tmp_path):
    samples = dict(FAKE)
    samples["u2"] = ("nolabel", [])
    root = write_fake(tmp_path / "fake", samples)
    clean = parse_protocol(fake_protocol(unlabelled_per_class=1, unlabelled=2), "fake.yaml")
    noisy = parse_protocol({**fake_protocol(unlabelled_per_class=1, unlabelled=2), "unlabelled_noise": "moderate"}, "n")
    kw = {"roots": {"fakeroot": root}, "echo": lambda *a: None, "patch_size": [4, 4]}
    a = load_sessions(clean, tmp_path / "c1", **kw)
    b = load_sessions(noisy, tmp_path / "c2", **kw)
    pool_a, pool_b = a[1].unlabelled, b[1].unlabelled
    assert pool_a.ids == pool_b.ids and len(pool_b) >= 3
    changed = [i for i in range(len(pool_b)) if not np.array_equal(pool_a.images[i], pool_b.images[i])]
    assert len(changed) == round(0.7 * len(pool_b))
    assert all(np.array_equal(pool_a.labels[i], pool_b.labels[i]) for i in range(len(pool_b)))
    for split in ("train", "test"):
        x, y = getattr(a[1], split), getattr(b[1], split)
        assert all(np.array_equal(x.images[i], y.images[i]) for i in range(len(x)))
