"""Protocols on public datasets: schema, roots, label maps, K-shot selection, manifests, lazy
splits, and every built-in paper protocol end to end on tiny fixture copies of its datasets."""

import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fixtures import medical as fxm  # noqa: E402
from fixtures import natural as fxn  # noqa: E402
from jascl.cli import main  # noqa: E402
from jascl.data.datasets import LabelledDataset  # noqa: E402
from jascl.data.layouts import LAYOUTS, DatasetLayout, Problem, Record, Sample  # noqa: E402
from jascl.data.real import (  # noqa: E402
    env_var,
    label_lut,
    load_manifest,
    load_real,
    open_source,
    parse_root_args,
    resolve_roots,
    select_k_shot,
)
from jascl.engine.config import resolve_config  # noqa: E402
from jascl.errors import ConfigError, DataError  # noqa: E402
from jascl.experiments.runner import run_benchmark  # noqa: E402
from jascl.protocols import builtin_protocols, get_protocol, parse_protocol  # noqa: E402
from jascl.protocols.schema import IGNORE_INDEX  # noqa: E402

# --------------------------------------------------------------------------------------------- a fake layout


class FakeLayout(DatasetLayout):
    """Test-only 2D layout: ``<root>/<split>/<id>.img.npy`` (1, H, W) and ``<id>.lab.npy`` (H, W).

    Native labels 0..5 are declared (0 = background); the split folder ``nolabel`` holds
    images without labels.
    """

    name = "fake-test"
    spatial_dims = 2

    def scan(self):
        if not self.root.is_dir():
            raise DataError(f"{self.root}: fake root not found")
        records = []
        for img in sorted(self.root.glob("*/*.img.npy")):
            rid = img.name[: -len(".img.npy")]
            split = img.parent.name
            label = None if split == "nolabel" else img.with_name(f"{rid}.lab.npy")
            records.append(Record(f"{split}/{rid}", (img,), label, split, {"group": rid.split("-")[0]}))
        return records

    def label_names(self):
        return {0: "background", **{i: f"c{i}" for i in range(1, 6)}}

    def check(self, record):
        return [Problem(p, "missing file", "restore it") for p in record.files if not p.is_file()]

    def read(self, record):
        image = np.load(record.images[0]).astype(np.float32)
        label = np.load(record.label).astype(np.int64) if record.label is not None else None
        return Sample(image, label)


if "fake-test" not in LAYOUTS:
    LAYOUTS.register("fake-test")(FakeLayout)


def write_fake(root: Path, samples: dict[str, tuple[str, list[int]]], size=(8, 8)) -> Path:
    """samples: id -> (split, native labels present). Label = vertical stripes of those values."""
    for rid, (split, values) in samples.items():
        folder = root / split
        folder.mkdir(parents=True, exist_ok=True)
        label = np.zeros(size, np.int64)
        for j, v in enumerate(values):
            label[:, j + 1] = v
        ramp = np.linspace(0.0, 0.5, size[0], dtype=np.float32)[:, None]  # no image is constant (run refuses those)
        np.save(folder / f"{rid}.img.npy", (label[None] * 10.0 + 1.0 + ramp).astype(np.float32))
        if split != "nolabel":
            np.save(folder / f"{rid}.lab.npy", label)
    return root


def fake_protocol(**session_overrides) -> dict:
    """Two sessions on one fake dataset: base teaches class 1 (native 1), session 1 classes 2, 3 (native 2, 3)."""
    sessions = [
        {"name": "base", "domains": ["d"], "new_classes": [1], "shots": "all", "sources": ["fake"]},
        {"name": "inc", "domains": ["d"], "new_classes": [2, 3], "shots": 2, "sources": ["fake"]},
    ]
    sessions[1].update(session_overrides)
    return {
        "name": "fake-proto",
        "seed": 5,
        "spatial_dims": 2,
        "in_channels": 1,
        "metric": "dice",
        "classes": [
            {"id": 0, "name": "background"},
            {"id": 1, "name": "one"},
            {"id": 2, "name": "two"},
            {"id": 3, "name": "three"},
        ],
        "domains": {"d": {}},
        "datasets": {
            "fake": {
                "layout": "fake-test",
                "root": "fakeroot",
                "domain": "d",
                "labels": {1: 1, 2: "two", "c3": 3, 5: "ignore"},
                "train_splits": ["train"],
                "test_splits": ["test"],
            }
        },
        "sessions": sessions,
        "training": {
            "backbone_args": {"features": [4, 4, 8, 8, 8, 8]},
            "patch_size": [8, 8],
            "epochs_base": 1,
            "epochs_incremental": 1,
            "batch_size": 2,
            "augment": False,
        },
    }


# Sample -> (split, native labels present). Class 2 (native 2) is in a, b, c; class 3 in c, d, e.
FAKE = {
    "a": ("train", [1, 2]),
    "b": ("train", [2]),
    "c": ("train", [2, 3]),
    "d": ("train", [1, 3]),
    "e": ("train", [3, 4]),
    "f": ("train", [1]),
    "t1": ("test", [1, 2]),
    "t2": ("test", [3]),
    "u1": ("nolabel", []),
}


@pytest.fixture
def fake_root(tmp_path):
    return write_fake(tmp_path / "fake", FAKE)


def _ids(split):
    return sorted(i.split("/", 2)[-1] for i in split.ids)


# --------------------------------------------------------------------------------------------- K-shot


def test_select_k_shot_hand_computed():
    # class 2 has the fewest candidates, so it is served first: b, e; then class 1 has b already (1 of 2) and adds a
    candidates = {1: ["a", "b", "c", "d"], 2: ["b", "e"]}
    classes = {"a": {1}, "b": {1, 2}, "c": {1}, "d": {1}, "e": {2}}
    selected, counts = select_k_shot(candidates, classes.__getitem__, 2)
    assert selected == ["b", "e", "a"]
    assert counts == {1: 2, 2: 2}
    # K = 3: class 2 cannot reach 3, class 1 still gets exactly 3 samples containing it
    selected, counts = select_k_shot(candidates, classes.__getitem__, 3)
    assert counts == {1: 3, 2: 2} and selected == ["b", "e", "a", "c"]


def test_k_shot_sessions_guarantee_k_per_class_and_are_seeded(fake_root, tmp_path):
    protocol = parse_protocol(fake_protocol(), "fake.yaml")
    data, manifest = load_real(protocol, {"fakeroot": fake_root}, tmp_path / "cache", echo=lambda *a: None)
    presence = {k: set(v[1]) for k, v in FAKE.items()}
    inc = data[1]
    chosen = _ids(inc.train)
    for native in (2, 3):
        assert sum(native in presence[i] for i in chosen) >= 2
    assert len(chosen) <= 4 and set(chosen) <= {"a", "b", "c", "d", "e"}
    # base (shots all): every training sample that contains class 1 (native 1); test: those with class 1
    assert _ids(data[0].train) == ["a", "d", "f"]
    assert _ids(data[0].test) == ["t1"]
    assert _ids(inc.test) == ["t1", "t2"]
    # the same seed selects the same shots; the manifest records them with dataset-qualified ids
    again, _ = load_real(protocol, {"fakeroot": fake_root}, tmp_path / "cache", echo=lambda *a: None)
    assert again[1].train.ids == inc.train.ids
    assert manifest["sessions"][1]["train"] == inc.train.ids and inc.train.ids[0].startswith("fake/train/")
    # samples used by the base session (a, d, f) come last, so K=2 leaves no choice: b, c for class 2 and
    # then e for class 3; with K=1 the seeded order decides
    assert _ids(inc.train) == ["b", "c", "e"]
    one_shot = parse_protocol(fake_protocol(shots=1), "fake.yaml")
    seeds = {
        tuple(
            _ids(
                load_real(
                    dataclasses.replace(one_shot, seed=s),
                    {"fakeroot": fake_root},
                    tmp_path / "cache",
                    echo=lambda *a: None,
                )[0][1].train
            )
        )
        for s in range(12)
    }
    assert len(seeds) > 1 and seeds <= {("b", "c"), ("c",), ("b", "e")}


def test_impossible_k_shot_is_one_line_naming_session_class_and_counts(fake_root, tmp_path):
    protocol = parse_protocol(fake_protocol(shots=4), "fake.yaml")
    with pytest.raises(DataError) as info:
        load_real(protocol, {"fakeroot": fake_root}, tmp_path / "cache", echo=lambda *a: None)
    message = str(info.value)
    assert "\n" not in message
    assert "session 1 (inc)" in message and "class 2 (two)" in message
    assert "only 3 training sample(s)" in message and "K=4" in message


# --------------------------------------------------------------------------------------------- label maps


def test_label_lut_follows_the_taught_from_rule(fake_root, tmp_path):
    protocol = parse_protocol(fake_protocol(), "fake.yaml")
    src = open_source(protocol, protocol.datasets["fake"], fake_root)
    # native: 0 "background", 1 -> class 1 (base), 2 -> class 2 and "c3" (a name) -> class 3 (session 1),
    # 4 unmapped (declared) -> background, 5 -> ignore, 9 undeclared -> ignore, 255 -> ignore
    # int64 ids, and uint8 ones (the store's labels: looked up two voxels at a time), odd and even in number
    for native in (np.array([0, 1, 2, 3, 4, 5, 9, 255]), np.array([0, 1, 2, 3, 4, 5, 9, 255], np.uint8)):
        assert label_lut(protocol, src, 0)(native).tolist() == [0, 1, 255, 255, 0, 255, 255, 255]
        assert label_lut(protocol, src, 1)(native).tolist() == [0, 1, 2, 3, 0, 255, 255, 255]
        assert label_lut(protocol, src, 1)(native[1:]).tolist() == [1, 2, 3, 0, 255, 255, 255]
    ignore = dataclasses.replace(protocol.datasets["fake"], unmapped="ignore")
    src_i = open_source(protocol, ignore, fake_root)
    assert label_lut(protocol, src_i, 1)(native).tolist() == [0, 1, 2, 3, 255, 255, 255, 255]


def test_label_name_not_in_dataset_is_one_line(fake_root):
    d = fake_protocol()
    d["datasets"]["fake"]["labels"]["kidney"] = 1
    protocol = parse_protocol(d, "fake.yaml")
    with pytest.raises(DataError, match=r"datasets\.fake\.labels\.kidney: 'kidney' is not a label name"):
        open_source(protocol, protocol.datasets["fake"], fake_root)


# --------------------------------------------------------------------------------------------- roots


def test_roots_precedence_and_errors(tmp_path):
    protocol = parse_protocol(fake_protocol(), "fake.yaml")
    file = tmp_path / "roots.yaml"
    file.write_text("fakeroot: /from/file\n")
    env = {env_var("fakeroot"): "/from/env"}
    assert env_var("bdd-10k") == "JASCL_ROOT_BDD_10K"
    assert resolve_roots(protocol, {}, None, env) == {"fakeroot": Path("/from/env")}
    assert resolve_roots(protocol, {}, file, env) == {"fakeroot": Path("/from/file")}
    assert resolve_roots(protocol, {"fakeroot": "/given"}, file, env) == {"fakeroot": Path("/given")}
    with pytest.raises(DataError) as info:
        resolve_roots(protocol, {}, None, {})
    assert "--root fakeroot=PATH" in str(info.value) and "JASCL_ROOT_FAKEROOT" in str(info.value)
    with pytest.raises(ConfigError, match="no dataset root of that name"):
        resolve_roots(protocol, {"fakerot": "/x"}, None, {})
    assert parse_root_args(["a=/x", "b = /y"]) == {"a": "/x", "b": "/y"}
    with pytest.raises(ConfigError, match="expected NAME=PATH"):
        parse_root_args(["nopath"])


# --------------------------------------------------------------------------------------------- manifests


def test_split_manifest_is_reused_and_validated(fake_root, tmp_path):
    protocol = parse_protocol(fake_protocol(), "fake.yaml")
    data, manifest = load_real(protocol, {"fakeroot": fake_root}, tmp_path / "cache", echo=lambda *a: None)
    path = tmp_path / "manifest.json"
    # hand-edited selection: the reused manifest wins over a new seed's selection
    manifest["sessions"][1]["train"] = ["fake/train/b", "fake/train/e"]
    path.write_text(json.dumps(manifest))
    reused, _ = load_real(
        dataclasses.replace(protocol, seed=99),
        {"fakeroot": fake_root},
        tmp_path / "cache",
        echo=lambda *a: None,
        split_manifest=path,
    )
    assert reused[1].train.ids == ["fake/train/b", "fake/train/e"]
    assert reused[0].test.ids == data[0].test.ids

    def broken(edit, fragment):
        m = json.loads(json.dumps(manifest))
        edit(m)
        path.write_text(json.dumps(m))
        with pytest.raises(DataError) as info:
            load_real(protocol, {"fakeroot": fake_root}, tmp_path / "cache", echo=lambda *a: None, split_manifest=path)
        assert fragment in str(info.value) and "\n" not in str(info.value), str(info.value)
        assert str(path) in str(info.value)

    broken(lambda m: m.update(protocol="other"), "made for protocol 'other'")
    broken(lambda m: m["sessions"].pop(), "has 1 sessions")
    broken(lambda m: m["sessions"][1].update(name="x"), "sessions[1] is 'x'")
    broken(lambda m: m["sessions"][1].update(shots=3), "shots=3")
    broken(lambda m: m["sessions"][1]["train"].append("fake/train/zz"), "sample 'train/zz' is not in dataset")
    broken(lambda m: m["sessions"][1]["train"].append("other/a"), "not one of the session's sources")
    broken(lambda m: m["sessions"][1]["train"].append("fake/test/t1"), "is also a test sample")
    with pytest.raises(DataError, match="not found"):
        load_manifest(tmp_path / "missing.json", protocol)


# --------------------------------------------------------------------------------------------- lazy splits


def test_lazy_split_interface_and_unlabelled_pool(tmp_path):
    samples = dict(FAKE)
    samples["u2"] = ("nolabel", [])
    root = write_fake(tmp_path / "fake", samples)
    write_fake(root, {"g": ("train", [2, 3])}, size=(6, 10))  # a differently sized sample
    protocol = parse_protocol(fake_protocol(unlabelled_per_class=1, unlabelled=2), "fake.yaml")
    data, _ = load_real(protocol, {"fakeroot": root}, tmp_path / "cache", echo=lambda *a: None, unlabelled_crop=[4, 4])
    train, pool = data[1].train, data[1].unlabelled
    assert len(train.images) == len(train) and train.images.ndim == 4 and train.labels.ndim == 3
    assert train.images.shape[:2] == (len(train), 1) and train.images.shape[2:] == (None, None)
    first = train.images[0]
    assert first.dtype == np.float32 and first.shape[0] == 1
    assert train.labels[0].dtype == np.uint8
    # slices: a stacked array when shapes agree, else a list of arrays
    test = data[1].test
    assert isinstance(test.images[0:2], np.ndarray) and test.images[0:2].shape == (2, 1, 8, 8)
    every = [train.images[i].shape for i in range(len(train))]
    whole = train.images[0 : len(train)]
    assert isinstance(whole, np.ndarray) == (len(set(every)) == 1)
    # the pool: no labelled shot, at least one sample per class, label-free records take part, crops of 4 x 4
    assert not set(pool.ids) & set(train.ids)
    assert len(pool) == len(set(pool.ids)) >= 2 + 1
    for i in range(len(pool)):
        image, label = pool.images[i], pool.labels[i]
        assert image.shape == (1, 4, 4) and label.shape == (4, 4)
    free = [i for i, ref in enumerate(pool.ids) if ref.startswith("fake/nolabel/")]
    for i in free:  # no ground truth at all: every pixel is ignore
        pool.images[i]
        assert (pool.labels[i] == IGNORE_INDEX).all()


def test_labelled_dataset_pads_and_crops_lazy_splits_around_taught_classes(fake_root, tmp_path):
    protocol = parse_protocol(fake_protocol(), "fake.yaml")
    data, _ = load_real(protocol, {"fakeroot": fake_root}, tmp_path / "cache", echo=lambda *a: None)
    split = data[1].train
    # patch larger than the 8 x 8 samples: padded with ignore (255) labels, image 0
    ds = LabelledDataset(split, [2, 3], patch_size=[10, 12], seed=0)
    item = ds[0]
    assert item["image"].shape == (1, 10, 12) and item["label"].shape == (10, 12)
    assert (item["label"][0] == IGNORE_INDEX).all() and (item["image"][:, 0] == 0).all()
    # small crops: about half are centred on a taught-class voxel, so a taught class shows in most of them
    ds = LabelledDataset(split, [2, 3], patch_size=[2, 2], seed=1)
    # (pass, index) keys: 80 distinct draws (an item's crop is fixed by its pass and index)
    items = [ds[(i // len(ds), i % len(ds))]["label"] for i in range(80)]
    hits = sum(bool(((label == 2) | (label == 3)).any()) for label in items)
    assert hits >= 35  # uniform 2 x 2 crops of these 8 x 8 stripes would hit a taught column about 25% of the time


# --------------------------------------------------------------------------------------------- schema


@pytest.mark.parametrize(
    "edit, key, reason",
    [
        (lambda d: d["sessions"][1].update(sources=["nope"]), "sessions[1].sources[0].dataset", "not declared"),
        (
            lambda d: d["sessions"][1].update(sources=[{"dataset": "fake", "classes": [1]}]),
            "sessions[1].sources[0].classes[0]",
            "not one of the session's classes",
        ),
        (lambda d: d["datasets"]["fake"]["labels"].pop(2), "sessions[1].sources", "have no source"),
        (lambda d: d["datasets"]["fake"].update(domain="e"), "datasets.fake.domain", "not declared"),
        (
            lambda d: d["datasets"]["fake"]["labels"].update({7: "seven"}),
            "datasets.fake.labels.7",
            "neither a declared",
        ),
        (lambda d: d["datasets"]["fake"].update(test_splits=["train"]), "datasets.fake.test_splits", "also training"),
        (lambda d: d["datasets"]["fake"].pop("layout"), "datasets.fake.layout", "is required"),
        (lambda d: d["sessions"][0].pop("sources"), "sessions[0].sources", "is required"),
        (lambda d: d["sessions"][1].update(source="x"), "sessions[1].source", "does not apply"),
    ],
)
def test_malformed_dataset_protocols_are_one_line(edit, key, reason):
    d = fake_protocol()
    edit(d)
    with pytest.raises(ConfigError) as info:
        parse_protocol(d, "bad.yaml")
    message = str(info.value)
    assert "\n" not in message and message.startswith("bad.yaml: ") and key in message and reason in message, message


def test_paper_protocol_facts():
    builtins = builtin_protocols()
    expected = {  # name: (sessions, foreground classes, shots of the incremental sessions)
        "med-disjoint": (6, 37, 5),
        "med-mixed": (5, 35, 5),
        "med-ss": (6, 37, 5),
        "natural": (3, 18, 10),
        "natural-ss": (4, 17, 10),
        "surgery": (3, 10, 50),
        "surgery-cil": (3, 10, 50),
        "surgery-dil": (2, 4, 50),
        "surgery-cdil": (3, 10, 50),
        "natural-cil": (2, 13, 10),
        "natural-dil": (2, 10, 10),
        "natural-cdil": (3, 18, 10),
    }
    assert set(expected) <= set(builtins)
    for name, (n_sessions, n_classes, shots) in expected.items():
        p = get_protocol(name)
        assert p.uses_datasets and len(p.sessions) == n_sessions and len(p.classes) - 1 == n_classes, name
        assert p.sessions[0].shots is None and all(s.shots == shots for s in p.sessions[1:]), name
        assert p.training["patch_size"], name  # real protocols train on patches
    # summary table: |C_t| per session
    assert [len(s.new_classes) for s in get_protocol("med-disjoint").sessions] == [15, 5, 6, 4, 3, 4]
    assert [len(s.new_classes) for s in get_protocol("med-mixed").sessions] == [10, 8, 6, 4, 7]
    assert [len(s.classes) for s in get_protocol("natural").sessions] == [10, 5, 5]
    assert [len(s.new_classes) for s in get_protocol("natural-ss").sessions] == [10, 2, 2, 3]
    assert [s.unlabelled for s in get_protocol("med-ss").sessions] == [0, 25, 30, 8, 15, 20]
    assert [s.unlabelled_per_class for s in get_protocol("natural-ss").sessions] == [0, 400, 400, 400]
    # validation samples per class: the smallest count of the "Val" column of the paper's split tables per session
    validation = {
        "med-disjoint": [17, 26, 4, 4, 4, 5],
        "med-ss": [17, 26, 4, 4, 4, 5],
        "med-mixed": [55, 4, 4, 4, 4],
        "natural": [189, 3, 3],
        "natural-cdil": [189, 3, 3],
        "natural-cil": [189, 3],
        "natural-dil": [189, 3],
        "natural-ss": [189, 3, 3, 3],
        "surgery": [154, 4, 15],
        "surgery-cdil": [154, 4, 15],
    }
    for name in expected:
        p = get_protocol(name)
        assert [s.validation for s in p.sessions] == validation.get(name, [0] * len(p.sessions)), name
        assert p.training.get("model_selection", "last") == ("best_val_new" if name in validation else "last"), name
    # recurring classes keep their global ids in the new domain
    mixed = get_protocol("med-mixed")
    assert mixed.sessions[2].recurring_classes == (2, 3, 7)
    ts = mixed.datasets["ts"].labels
    assert (ts["kidney_right"], ts["kidney_left"], ts["stomach"]) == (2, 3, 7)
    assert mixed.datasets["amos"].labels[2] == 2 and mixed.datasets["amos"].labels[7] == 7
    natural = get_protocol("natural")
    assert natural.sessions[2].recurring_classes == (8, 9)
    assert natural.datasets["idd"].labels[4] == 8 and natural.datasets["bdd"].labels[11] == 8  # person
    assert [(s.dataset, s.classes) for s in natural.sessions[2].sources] == [("bdd", (16, 17, 18)), ("idd", (8, 9))]
    # med-disjoint classes end with the vertebrae C3, C4, T1, T2 (VerSe labels 3, 4, 8, 9)
    disjoint = get_protocol("med-disjoint")
    assert disjoint.datasets["verse"].labels == {3: 34, 4: 35, 8: 36, 9: 37}
    assert disjoint.datasets["brats"].labels == {1: 31, 2: 32, 4: 33}


# --------------------------------------------------------------------------------------------- end to end

TINY = {
    "backbone": "unet",
    "backbone_args": {"features": [4, 4, 8, 8, 8, 8]},
    "epochs_base": 1,
    "epochs_incremental": 1,
    "batch_size": 2,
    "augment": False,
    "device": "cpu",
    "freeze_incremental": "none",
}


def tiny_config(protocol, patch):
    overrides = [f"{k}={json.dumps(v)}" for k, v in {**TINY, "patch_size": patch}.items()]
    return resolve_config(protocol.training, protocol.path, None, overrides)


def shrink_images(protocol, size=(32, 64)):
    """The built-in protocol with its 2D datasets resized to ``size`` instead of ~512 x 1024 (test speed)."""
    datasets = {
        n: dataclasses.replace(d, preprocess={**d.preprocess, "size": list(size)}) for n, d in protocol.datasets.items()
    }
    return dataclasses.replace(protocol, datasets=datasets)


MED_SHAPE = (32, 32, 24)  # 32^3 after resampling to 1.5 mm: the smallest the tiny U-Net takes


def write_medical_roots(root: Path, protocol, cases: int = 7) -> dict[str, Path]:
    """Fixture copies of every dataset of a medical protocol, holding the native labels it maps."""
    out = {}
    for spec in protocol.datasets.values():
        folder = root / spec.root
        if spec.layout == "totalsegmentator":
            out[spec.root] = fxm.write_totalsegmentator(
                folder,
                subjects=cases,
                shape=MED_SHAPE,
                structures=spec.options["structures"],
                splits=["train"] * (cases - 2) + ["val", "test"],
            )
        elif spec.layout == "brats":
            out[spec.root] = fxm.write_brats(folder, subjects=cases, shape=MED_SHAPE)
        else:
            labels = sorted(k for k in spec.labels if isinstance(k, int) and k != 0)
            out[spec.root] = fxm.write_msd(folder, cases=cases, shape=MED_SHAPE, labels=labels, test_cases=2)
    return out


NATURAL_WRITERS = {
    "bdd100k": fxn.write_bdd100k,
    "idd": fxn.write_idd,
    "cityscapes": fxn.write_cityscapes,
    "m2caiseg": fxn.write_m2caiseg,
}


def write_natural_roots(root: Path, protocol, per_split: int) -> dict[str, Path]:
    out = {}
    for spec in protocol.datasets.values():
        folder = root / spec.root
        if spec.layout == "cholecseg8k":  # one of four videos is held out for testing
            out[spec.root] = fxn.write_cholecseg8k(
                folder, per_split=per_split // 3 + 2, size=(32, 64), videos=("video01", "video09", "video12", "video17")
            )
        else:
            out[spec.root] = NATURAL_WRITERS[spec.layout](folder, per_split=per_split, size=(32, 64))
    return out


def same_spacing(protocol, spacing=(1.5, 1.5, 1.5)):
    """The protocol with every dataset resampled to one spacing, so all fixture volumes end up 32^3 (BraTS is
    resampled to 1 mm otherwise, 48^3): the smallest the tiny U-Net takes, for the suite's time. Samples of
    several sizes are tested by test_prototypes_of_variable_size_samples and tests/test_whole_samples.py;
    tools/every_method_on_fixtures.py runs every method with the protocols' own spacings.
    """
    datasets = {
        n: dataclasses.replace(d, preprocess={**d.preprocess, "spacing": list(spacing)})
        for n, d in protocol.datasets.items()
    }
    return dataclasses.replace(protocol, datasets=datasets)


def _run_end_to_end(name, tmp_path):
    protocol = get_protocol(name)
    if protocol.spatial_dims == 3:
        protocol = same_spacing(protocol)
        roots = write_medical_roots(tmp_path / "data", protocol)
        patch = [32, 32, 32]
    else:
        protocol = shrink_images(protocol)
        shots = max(s.shots or 0 for s in protocol.sessions)
        roots = write_natural_roots(tmp_path / "data", protocol, per_split=shots + 2)
        patch = [32, 32]
    semi = any(s.unlabelled or s.unlabelled_per_class for s in protocol.sessions)
    config = tiny_config(protocol, patch)
    if semi:  # an unlabelled phase in the one epoch, so the pools are used
        config.method_args = {"jascl": {"pas": {"start_epoch": 0, "every": 1}}}
    methods = ["jascl"] if semi else ["vanilla"]
    results = run_benchmark(
        protocol,
        config,
        methods,
        tmp_path / "run",
        cache_dir=tmp_path / "cache",
        progress=False,
        echo=lambda *a: None,
        roots=roots,
    )
    records = results["methods"][methods[0]]["sessions"]
    assert [r["session"] for r in records] == list(range(len(protocol.sessions)))
    for t, record in enumerate(records):  # every class seen so far is scored (present in the test data)
        seen = [c for c in protocol.seen_classes(t) if c != 0]
        scored = [int(c) for c, v in record["per_class"].items() if int(c) != 0 and v == v]
        assert sorted(scored) == sorted(seen), (name, t)
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["protocol"] == name and len(manifest["sessions"]) == len(protocol.sessions)
    for s, entry in zip(protocol.sessions, manifest["sessions"]):
        datasets = {src.dataset for src in s.sources}
        assert entry["train"] and all(ref.split("/", 1)[0] in datasets for ref in entry["train"] + entry["test"])
        assert not set(entry["train"]) & set(entry["test"])
        validation = set(entry.get("validation", []))  # none when the tiny copy has no sample to spare
        assert not validation & (set(entry["train"]) | set(entry["test"]) | set(entry.get("unlabelled") or []))
    for s, record in zip(protocol.sessions, records):  # the paper's protocols keep the best validation epoch
        assert (record.get("selection") or {}).get("mode") == ("best_val_new" if s.validation else None), (name, s)
    return protocol, roots, manifest


def test_end_to_end_through_the_cli_with_roots_and_manifest_reuse(tmp_path, capsys):
    # the fake protocol as a YAML file, samples of 32 x 32 (the tiny U-Net's minimum)
    root = write_fake(tmp_path / "fake", FAKE, size=(32, 32))
    path = tmp_path / "fake-proto.yaml"
    path.write_text(yaml.safe_dump(fake_protocol()))
    common = [
        "--methods",
        "vanilla",
        "--cache-dir",
        str(tmp_path / "cache"),
        "--no-progress",
        "--root",
        f"fakeroot={root}",
    ] + [f"--set={k}={json.dumps(v)}" for k, v in {**TINY, "patch_size": [32, 32]}.items()]
    assert main(["run", "--protocol", str(path), "--out", str(tmp_path / "a"), *common]) == 0, capsys.readouterr().err
    first = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert first["datasets"]["fake"] == {"layout": "fake-test", "root": "fakeroot", "path": str(root)}
    assert first["sessions"][1]["train"] == ["fake/train/b", "fake/train/c", "fake/train/e"]
    results = json.loads((tmp_path / "a" / "results.json").read_text())
    scored = results["methods"]["vanilla"]["sessions"][1]["per_class"]
    assert {c for c, v in scored.items() if v == v} == {"0", "1", "2", "3"}
    # another seed with the first run's manifest: the same samples; without it, the seed's own selection
    manifest = tmp_path / "a" / "manifest.json"
    edited = json.loads(manifest.read_text())
    edited["sessions"][1]["train"] = ["fake/train/c", "fake/train/d"]
    manifest.write_text(json.dumps(edited))
    assert (
        main(
            [
                "run",
                "--protocol",
                str(path),
                "--out",
                str(tmp_path / "b"),
                "--seed",
                "3",
                "--split-manifest",
                str(manifest),
                *common,
            ]
        )
        == 0
    ), capsys.readouterr().err
    again = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert again["seed"] == 3 and again["sessions"][1]["train"] == ["fake/train/c", "fake/train/d"]
    assert [e["test"] for e in again["sessions"]] == [e["test"] for e in first["sessions"]]
    edited["protocol"] = "something-else"
    manifest.write_text(json.dumps(edited))
    assert (
        main(["run", "--protocol", str(path), "--out", str(tmp_path / "c"), "--split-manifest", str(manifest), *common])
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "made for protocol 'something-else'" in err


def test_run_requires_roots_and_patch_size(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("JASCL_ROOT_BDD100K", raising=False)
    assert main(["run", "--protocol", "natural-cil", "--out", str(tmp_path / "r"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--root bdd100k=PATH" in err and "JASCL_ROOT_BDD100K" in err
    assert (
        main(
            [
                "run",
                "--protocol",
                "natural-cil",
                "--out",
                str(tmp_path / "r"),
                "--set",
                "patch_size=null",
                "--root",
                f"bdd100k={tmp_path}",
            ]
        )
        == 2
    )
    assert "patch_size is null" in capsys.readouterr().err


PAPER_PROTOCOLS = [
    "med-disjoint",
    "med-mixed",
    "med-ss",
    "natural",
    "natural-ss",
    "natural-cil",
    "natural-dil",
    "natural-cdil",
    "surgery",
    "surgery-cil",
    "surgery-dil",
    "surgery-cdil",
]


@pytest.mark.slow
@pytest.mark.parametrize("name", PAPER_PROTOCOLS)
def test_paper_protocol_runs_end_to_end_on_fixtures(name, tmp_path):
    torch.manual_seed(0)
    _run_end_to_end(name, tmp_path)


def test_synthetic_manifest_reuse_must_name_the_generated_samples(toy_protocol, tmp_path):
    from jascl.data.sessions import load_sessions, write_manifest

    data = load_sessions(toy_protocol, tmp_path / "cache", echo=lambda *a: None)
    path = tmp_path / "manifest.json"
    write_manifest(toy_protocol, data, path)
    assert (
        load_sessions(toy_protocol, tmp_path / "cache", echo=lambda *a: None, split_manifest=path)[1].train.ids
        == data[1].train.ids
    )
    other = dataclasses.replace(toy_protocol, seed=toy_protocol.seed + 1)
    with pytest.raises(DataError, match="made with seed 3, this run has seed 4"):
        load_sessions(other, tmp_path / "cache", echo=lambda *a: None, split_manifest=path)
    manifest = json.loads(path.read_text())
    manifest["sessions"][1]["train"] = manifest["sessions"][1]["train"][:-1]
    path.write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=r"sessions\[1\]\.train lists other samples"):
        load_sessions(toy_protocol, tmp_path / "cache", echo=lambda *a: None, split_manifest=path)


def write_several_sizes(root: Path) -> Path:
    """The fake layout with samples of 32 x 32, 32 x 48 and 48 x 32 (five train, three test; classes 1-3)."""
    samples = {
        "a": ("train", [1, 2]),
        "b": ("train", [2, 3]),
        "c": ("train", [3, 2]),
        "t1": ("test", [1, 2]),
        "t2": ("test", [3]),
    }
    write_fake(root, samples, size=(32, 32))
    write_fake(root, {"d": ("train", [1, 3])}, size=(32, 48))
    write_fake(root, {"e": ("train", [1, 2]), "t3": ("test", [1, 3])}, size=(48, 32))
    return root


def test_prototypes_of_variable_size_samples(tmp_path):
    root = write_several_sizes(tmp_path / "fake")
    protocol = parse_protocol(fake_protocol(), "fake.yaml")
    config = tiny_config(protocol, [32, 32])
    results = run_benchmark(
        protocol,
        config,
        ["vanilla"],
        tmp_path / "run",
        cache_dir=tmp_path / "cache",
        progress=False,
        echo=lambda *a: None,
        roots={"fakeroot": root},
    )
    scored = results["methods"]["vanilla"]["sessions"][1]["per_class"]
    assert {c for c, v in scored.items() if v == v} == {"0", "1", "2", "3"}
