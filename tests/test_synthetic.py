"""The embedded synthetic benchmark: determinism, caching, K-shot structure, label policy."""

import numpy as np
import pytest

from conftest import toy_protocol_dict
from jascl.data.datasets import LabelledDataset, plain_tensors, training_labels
from jascl.data.synthetic import SHAPES, SyntheticRenderer, class_intensity, load_or_generate, protocol_digest
from jascl.protocols import get_protocol, parse_protocol


def test_generation_is_deterministic_and_cached(toy_protocol, tmp_path):
    a = load_or_generate(toy_protocol, tmp_path / "c1")
    b = load_or_generate(toy_protocol, tmp_path / "c2")
    for x, y in zip(a, b):
        assert np.array_equal(x.train.images, y.train.images) and np.array_equal(x.test.labels, y.test.labels)
    files = sorted(p.name for p in (tmp_path / "c1" / "synthetic").glob("*/*.npz"))
    assert files == ["session0.npz", "session1.npz"]
    c = load_or_generate(toy_protocol, tmp_path / "c1")  # from the cache
    assert c[1].train.ids == a[1].train.ids and np.array_equal(c[1].train.images, a[1].train.images)


def test_seed_changes_data_and_cache_key(toy_protocol):
    other = parse_protocol({**toy_protocol_dict(), "seed": 4}, "toy.yaml")
    assert protocol_digest(other) != protocol_digest(toy_protocol)
    r1, r2 = SyntheticRenderer(toy_protocol), SyntheticRenderer(other)
    s = toy_protocol.sessions[0]
    assert not np.array_equal(r1.session(s).train.images, r2.session(s).train.images)


def test_k_shot_structure_and_splits(toy_protocol, tmp_path):
    base, inc = load_or_generate(toy_protocol, tmp_path)
    assert len(base.train) == 8 and len(base.test) == 4
    # K = 2 shots for each of the taught classes 3 (new) and 1 (recurring): 4 labelled images
    assert len(inc.train) == 4
    assert inc.train.ids[0] == "s1-inc/train/00000"
    for labels, cls in zip(inc.train.labels, [3, 3, 1, 1]):
        assert (labels == cls).any()
    # test images only hold the session's classes (0, 1, 3); training images may hold distractors (2)
    assert set(np.unique(inc.test.labels)) <= {0, 1, 3}
    assert set(np.unique(base.train.labels)) <= {0, 1, 2}


def test_domains_change_appearance(toy_protocol):
    a, b = toy_protocol.domains["a"], toy_protocol.domains["b"]
    assert class_intensity(3, a, 1) == class_intensity(3, a, 1)
    r = SyntheticRenderer(toy_protocol)
    img_a, lab_a = r.render(np.random.default_rng(0), a, [1])
    img_b, lab_b = r.render(np.random.default_rng(0), b, [1])
    assert np.array_equal(lab_a, lab_b)  # same geometry
    # domain b inverts contrast: the object is darker than the background there
    assert img_a[0][lab_a == 1].mean() > img_a[0][lab_a == 0].mean()
    assert img_b[0][lab_b == 1].mean() < img_b[0][lab_b == 0].mean()


@pytest.mark.parametrize("dims", [2, 3])
def test_every_shape_renders_in_2d_and_3d(dims):
    proto = parse_protocol(toy_protocol_dict(dims), "toy.yaml")
    r = SyntheticRenderer(proto)
    for shape in SHAPES:
        mask = r._object_mask(np.random.default_rng(1), shape)
        assert mask.shape == proto.synthetic.size and 0 < mask.sum() < mask.size, shape


def test_training_label_policy():
    gt = np.array([[0, 1, 2], [3, 2, 255]])
    assert training_labels(gt, [2], "background").tolist() == [[0, 0, 2], [0, 2, 0]]
    assert training_labels(gt, [2], "ignore").tolist() == [[0, 255, 2], [255, 2, 255]]


def test_dataset_items_equal_monai_metatensor_pipeline(toy_protocol, tmp_path):
    """The loader's MONAI transforms run without metadata tracking: same crops and flips as with it, switch restored."""
    import torch
    from monai.data import get_track_meta

    from jascl.data.sampling import derive_seed

    _, inc = load_or_generate(toy_protocol, tmp_path)
    ds = LabelledDataset(inc.train, [3, 1], augment=True, patch_size=[16, 24], seed=5)
    images = {}
    for key in [(p, i) for p in range(3) for i in range(len(ds))]:
        item = ds[key]
        assert get_track_meta() is True
        # the same transform with MONAI's default MetaTensors
        ds.transform.set_random_state(seed=derive_seed(5, *key))
        label = torch.from_numpy(training_labels(inc.train.labels[key[1]], [3, 1]))
        ref = ds.transform({"image": torch.from_numpy(inc.train.images[key[1]]), "label": label[None]})
        assert type(ref["image"]).__name__ == "MetaTensor" and type(item["image"]) is torch.Tensor
        assert torch.equal(item["image"], ref["image"].as_tensor())
        assert torch.equal(item["label"], ref["label"][0].long())
        images[key] = item["image"]
    # crops and flips are drawn per pass: a sample differs between passes
    assert any(not torch.equal(images[(0, i)], images[(1, i)]) for i in range(len(ds)))
    with pytest.raises(KeyError), plain_tensors():
        assert get_track_meta() is False
        raise KeyError("the switch comes back after an error too")
    assert get_track_meta() is True


def test_dataset_hides_untaught_classes(toy_protocol, tmp_path):
    _, inc = load_or_generate(toy_protocol, tmp_path)
    ds = LabelledDataset(inc.train, [3, 1], augment=True, seed=0)
    for i in range(len(ds)):
        item = ds[i]
        assert item["image"].shape == (1, 32, 32) and item["label"].dtype.is_floating_point is False
        assert set(item["label"].unique().tolist()) <= {0, 1, 3}  # distractor class 2 became background


def test_builtin_synthetic_2d_has_recurring_classes_in_new_domain():
    p = get_protocol("synthetic-2d")
    last = p.sessions[-1]
    assert last.recurring_classes == (1, 2) and last.domains != p.sessions[0].domains
    assert [s.shots for s in p.sessions] == [None, 5, 5, 5]


def test_unlabelled_pool_per_class_and_noise_schedule(tmp_path):
    from jascl.data.sessions import load_sessions

    d = toy_protocol_dict()
    d["sessions"][1]["unlabelled"] = 2
    d["sessions"][1]["unlabelled_per_class"] = 3
    clean = load_sessions(parse_protocol(d, "toy.yaml"), tmp_path)
    pool = clean[1].unlabelled
    # 2 from the domain + 3 per taught class (3 and 1); per-class samples show their class
    assert len(pool) == 2 + 3 * 2 and clean[0].unlabelled is None
    for labels, cls in zip(pool.labels[2:], [3, 3, 3, 1, 1, 1]):
        assert (labels == cls).any()
    d["unlabelled_noise"] = "heavy"
    noisy = load_sessions(parse_protocol(d, "toy.yaml"), tmp_path)
    changed = [not np.array_equal(a, b) for a, b in zip(pool.images, noisy[1].unlabelled.images)]
    assert sum(changed) == round(0.7 * len(pool))  # 70% of the pool is degraded
    assert np.array_equal(noisy[1].train.images, clean[1].train.images)  # labelled data untouched


def test_iterate_steps_matches_plain_epochs_and_extends():
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from jascl.data.datasets import iterate_steps

    def loader():
        return DataLoader(
            TensorDataset(torch.arange(10)), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(0)
        )

    plain, stepped = loader(), loader()
    for _ in range(3):  # three epochs: the sampler's random stream must stay in step
        a = [b[0].tolist() for b in plain]
        b = [x[0].tolist() for x in iterate_steps(stepped, len(stepped))]
        assert a == b
    longer = [x[0].tolist() for x in iterate_steps(loader(), 7)]  # 2 whole passes of 3 batches + 1
    assert len(longer) == 7 and sorted(sum(longer[:3], [])) == list(range(10))
