"""The preprocessed store read by crops, and ``jascl data prepare``: crop reads equal crops of whole reads, the
foreground index, kill and resume, stale / old-format / damaged entries rebuilt."""

import functools
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch
import yaml
from torch.utils.data import default_collate

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fixtures import medical as fxm  # noqa: E402
from jascl.cli import main  # noqa: E402
from jascl.data.cache import cached  # noqa: E402
from jascl.data.datasets import LabelledDataset, RandStoreCrop, collate_items, training_labels  # noqa: E402
from jascl.data.layouts import LAYOUTS  # noqa: E402
from jascl.data.layouts.msd import MSDLayout  # noqa: E402
from jascl.data.prepare import prepare_protocol  # noqa: E402
from jascl.data.real import (  # noqa: E402
    SampleStore,
    label_lut,
    load_real,
    open_sources,
    random_crop,
    resolve_roots,
    storage,  # noqa: E402
)
from jascl.data.real import store as store_module  # noqa: E402
from jascl.data.real.sources import PREPROCESS_VERSIONS  # noqa: E402
from jascl.data.real.storage import SplitBackend, crop_starts  # noqa: E402
from jascl.data.real.store import FOREGROUND_CAP, foreground_index, open_entry  # noqa: E402
from jascl.errors import ConfigError, DataError  # noqa: E402
from jascl.protocols import parse_protocol  # noqa: E402
from jascl.protocols.schema import IGNORE_INDEX  # noqa: E402

SHAPE = (20, 18, 16)
QUIET = {"echo": lambda *a: None}


protocol_dict = fxm.store_protocol_dict


@pytest.fixture
def copy(tmp_path):
    root = fxm.write_msd(tmp_path / "ct", cases=4, shape=SHAPE, labels=(1, 2), test_cases=1)
    return parse_protocol(protocol_dict(), "store-proto.yaml"), {"ct": root}


def _store(protocol, roots, cache):
    sources = open_sources(protocol, resolve_roots(protocol, roots), cache, **QUIET)
    return SampleStore(protocol, sources, cache)


def _entry_arrays(path: Path) -> dict:
    with np.load(path / "index.npz") as z:
        index = {k: z[k] for k in z.files}
    index["coords"] = np.load(path / "coords.npy")
    label = np.load(path / "label.npy") if (path / "label.npy").is_file() else None
    return {"image": np.load(path / "image.npy"), "label": label, **index}


# --------------------------------------------------------------------------------------------- crop reads


def test_crop_reads_equal_the_same_crop_of_the_whole_sample(copy, tmp_path):
    protocol, roots = copy
    data, _ = load_real(protocol, roots, tmp_path / "cache", **QUIET)
    split = data[0].train  # session 0: native 2 (spleen, taught later) is 255 here
    reader = split.images.crop_reader
    assert reader is not None
    for i in range(len(split)):
        image, label = split.images[i], split.labels[i]
        assert image.shape == (1, *SHAPE) and reader.spatial_shape(i) == SHAPE
        assert set(np.unique(label)) == {0, 1, IGNORE_INDEX}  # the session's label map is applied
        pad = 6
        padded_image = np.pad(image, [(0, 0)] + [(pad, pad)] * 3)
        padded_label = np.pad(label, [(pad, pad)] * 3, constant_values=IGNORE_INDEX)
        # inside, at the far corner, reaching out on both sides of an axis, larger than the sample
        for starts, size in [
            ((3, 4, 5), (8, 8, 8)),
            ((12, 10, 8), (8, 8, 8)),
            ((-3, 0, 10), (8, 7, 9)),
            ((-2, -5, -1), (24, 26, 20)),
            ((17, 15, 13), (5, 5, 5)),
        ]:
            box = tuple(slice(a + pad, a + pad + s) for a, s in zip(starts, size))
            got_image, got_label = reader.read_box(i, starts, size)
            assert np.array_equal(got_image, padded_image[(slice(None),) + box])
            assert np.array_equal(got_label, padded_label[box]) and got_label.dtype == np.uint8
            # a label function (the training-label policy) is applied inside the sample only: padding stays 255
            _, hidden = reader.read_box(i, starts, size, lambda g: training_labels(g, [1], "background"))
            expected = padded_label[box].copy()
            inside = np.zeros(padded_label.shape, bool)
            inside[pad:-pad, pad:-pad, pad:-pad] = True
            expected[inside[box] & (expected == IGNORE_INDEX)] = 0
            assert np.array_equal(hidden, expected)
    # the fixture's labels are uint8: their crops were mapped two voxels at a time (odd sizes included: 5 x 5 x 5)
    tables = list(reader._tables.values())
    assert tables and all(table.pairs is not None for table in tables)


def test_flipped_crop_reads_and_training_items_equal_the_flipped_crop(copy, tmp_path):
    """The flips written during the read equal ``np.flip`` of the unflipped read; a training item's crop and
    flips equal the earlier read-then-flip with the same draws; its label is the loader's uint8, contiguous."""
    protocol, roots = copy
    data, _ = load_real(protocol, roots, tmp_path / "cache", **QUIET)
    split = data[0].train
    reader = split.images.crop_reader
    hide = functools.partial(training_labels, taught=[1], other_classes="background")
    for starts, size in [((3, 4, 5), (8, 8, 8)), ((-3, 0, 10), (8, 7, 9)), ((-2, -5, -1), (24, 26, 20))]:
        image, label = reader.read_box(0, starts, size, hide)
        for axes in [(0,), (2,), (0, 1), (0, 1, 2)]:
            got_image, got_label = reader.read_box(0, starts, size, hide, axes)
            assert np.array_equal(got_image, np.flip(image, [a + 1 for a in axes]))
            assert np.array_equal(got_label, np.flip(label, axes)) and got_label.dtype == np.uint8
            assert got_image.flags.c_contiguous and got_label.flags.c_contiguous
    crop = RandStoreCrop(reader, (8, 8, 8), 0.5, [1], flip=True)
    flipped = 0
    for seed in range(8):
        crop.set_random_state(seed)
        image, label = crop(1)
        crop.set_random_state(seed)  # the earlier order of draws: placement, then one draw per axis
        starts = crop.randomize(1)
        axes = [a for a in range(3) if crop.R.random_sample() < 0.5]
        want_image, want_label = reader.read_box(1, starts, (8, 8, 8), crop.label_fn)
        assert np.array_equal(image, np.flip(want_image, [a + 1 for a in axes]))
        assert np.array_equal(label, np.flip(want_label, axes))
        flipped += bool(axes)
    assert flipped >= 4  # the seeds exercise the flips
    # the training loader's items: uint8 labels (through a worker process too), the values of the int64 items
    uint8 = LabelledDataset(split, [1], augment=True, patch_size=(8, 8, 8), seed=2, label_dtype=torch.uint8)
    int64 = LabelledDataset(split, [1], augment=True, patch_size=(8, 8, 8), seed=2)
    keys = [(p, i) for p in range(2) for i in range(len(split))]
    for key in keys:
        a, b = uint8[key], int64[key]
        assert a["label"].dtype == torch.uint8 and b["label"].dtype == torch.int64
        assert torch.equal(a["label"].long(), b["label"]) and torch.equal(a["image"], b["image"])
        assert a["ignore"] == b["ignore"]
    loader = torch.utils.data.DataLoader(uint8, batch_size=2, sampler=keys, num_workers=1)
    batches = list(loader)
    assert all(batch["label"].dtype == torch.uint8 for batch in batches)
    assert torch.equal(batches[0]["label"][1].long(), int64[keys[1]]["label"])


def test_a_training_batch_read_into_its_slots_equals_the_stacked_items(copy, tmp_path):
    """``__getitems__`` reads a batch's patches into one batch (shared memory in a worker) and ``collate_items``
    hands it on as it is: the values of torch's stacking of ``self[key]`` items, with padding, flips and ids."""
    protocol, roots = copy
    data, _ = load_real(protocol, roots, tmp_path / "cache", **QUIET)
    split = data[0].train
    # (10, 10, 20): larger than the 20 x 18 x 16 sample along the last axis, so every patch is padded there
    for patch in [(8, 8, 8), (10, 10, 20)]:
        dataset = LabelledDataset(split, [1], augment=True, patch_size=patch, seed=5, label_dtype=torch.uint8)
        keys = [(p, i) for p in range(3) for i in range(len(split))]
        want = default_collate([dataset[k] for k in keys])
        items = dataset.__getitems__(keys)
        assert items[0]["image"]._base is items[-1]["image"]._base  # slots of one batch
        got = collate_items(items)
        assert got["image"] is items[0]["image"]._base and got["label"].dtype == torch.uint8
        assert list(got) == list(want) and got["id"] == want["id"]
        for key in ("image", "label", "ignore"):
            assert torch.equal(got[key], want[key]), key
        assert bool(want["ignore"].all()) == (patch[2] > SHAPE[2])
        # items that are not one batch's slots, in order, are stacked
        swapped = collate_items([items[1], items[0]])
        assert torch.equal(swapped["image"], torch.stack([want["image"][1], want["image"][0]]))
    # through a worker process: the batch comes from shared memory, equal to the in-process one
    batches = list(
        torch.utils.data.DataLoader(
            dataset, batch_sampler=[keys[:2], keys[2:4]], num_workers=1, collate_fn=collate_items
        )
    )
    assert torch.equal(batches[1]["image"], want["image"][2:4]) and torch.equal(batches[1]["label"], want["label"][2:4])


def test_unlabelled_crops_are_those_of_the_whole_volume(copy, tmp_path):
    protocol, roots = copy
    store = _store(protocol, roots, tmp_path / "cache")
    refs = sorted(f"ct/{r}" for r in store.sources["ct"].records)
    lut = {"ct": lambda native: np.asarray(native, np.uint8)}
    for size in [(8, 8, 8), (24, 6, 20)]:
        backend = SplitBackend(store, refs, lut, crop=size, seed=4)
        rng = np.random.default_rng([4, 31337])  # the backend's stream
        for i in range(len(refs)):
            image, native = store.load(refs[i])
            full = np.full(SHAPE, IGNORE_INDEX, np.uint8) if native is None else lut["ct"](native)  # label-free
            want_image, want_label = random_crop(image, full, size, rng)
            got_image, got_label = backend.get(i, "image")
            assert np.array_equal(got_image, want_image) and np.array_equal(got_label, want_label)
    # a crop larger than the sample along axis 0: padded by 2 (1 before), so the only start there is -1
    assert crop_starts((4, 10), (6, 10), np.random.default_rng(0)) == [-1, 0]


# --------------------------------------------------------------------------------------------- foreground index


def test_foreground_index_hand_computed():
    label = np.zeros((4, 5, 6), np.uint8)
    label[1, 2, 3] = 7
    label[3, 4, 5] = 7
    label[0, 0, 0] = 2
    natives, counts, coords = foreground_index(label)
    assert natives.tolist() == [0, 2, 7] and counts.tolist() == [117, 1, 2]
    assert coords[1].tolist() == [[0, 0, 0]] and coords[2].tolist() == [[1, 2, 3], [3, 4, 5]]
    assert len(coords[0]) == 117 and (label[tuple(coords[0].T)] == 0).all()
    # a large class is capped, drawn without repetition and reproducibly
    big = np.zeros((40, 40, 40), np.uint8)
    big[:20] = 1
    n1, c1, x1 = foreground_index(big)
    assert c1.tolist() == [32000, 32000] and [len(x) for x in x1] == [FOREGROUND_CAP, FOREGROUND_CAP]
    assert len({tuple(v) for v in x1[0]}) == FOREGROUND_CAP and (big[tuple(x1[1].T)] == 1).all()
    assert all(np.array_equal(a, b) for a, b in zip(x1, foreground_index(big)[2]))


def test_foreground_biased_crop_contains_the_class(tmp_path):
    root = fxm.write_msd(tmp_path / "ct", cases=4, shape=SHAPE, labels=(1, 2), test_cases=1)
    # case_000: class 2's box removed, one voxel of native 2 at file voxel (17, 3, 9) instead
    fxm.rewrite_volume(root / "labelsTr" / "case_000.nii.gz", lambda d: np.minimum(d, 1).astype(np.uint8))
    fxm.write_label_value(root / "labelsTr" / "case_000.nii.gz", 2, (17, 3, 9))
    protocol = parse_protocol(protocol_dict(), "store-proto.yaml")
    store = _store(protocol, {"ct": root}, tmp_path / "cache")
    refs = sorted(f"ct/{r}" for r in store.sources["ct"].records)
    reader = SplitBackend(store, refs, {"ct": label_lut(protocol, store.sources["ct"], 1)})  # session 1: class 2
    i = refs.index("ct/case_000")
    # the fixture's affine has LPS signs: RAS flips axes 0 and 1, so the voxel is at (20-1-17, 18-1-3, 9)
    counts, coords = reader.foreground(i, [2])
    assert counts.tolist() == [1] and coords[0].tolist() == [[2, 14, 9]]
    assert reader.get(i, "label")[1][2, 14, 9] == 2
    # in session 0, class 2 is not taught yet: its voxels are 255, so no crop is centred on them
    session0 = SplitBackend(store, refs, {"ct": label_lut(protocol, store.sources["ct"], 0)})
    assert session0.foreground(i, [2])[0].tolist() == [] and session0.foreground(i, [1])[0].sum() > 0
    crop = RandStoreCrop(reader, (8, 8, 8), 1.0, [2])
    for seed in range(5):
        crop.set_random_state(seed)
        label = crop(i)[1]
        # centred on the voxel, clamped to the volume: starts (max(2-4, 0), min(14-4, 18-8), 9-4) = (0, 10, 5)
        assert label.shape == (8, 8, 8) and label[2, 4, 4] == 2 and (label == 2).sum() == 1


# --------------------------------------------------------------------------------------------- prepare


def test_prepare_fills_the_store_and_label_index_that_runs_read(copy, tmp_path, capsys):
    protocol, roots = copy
    path = tmp_path / "store-proto.yaml"
    path.write_text(yaml.safe_dump(protocol_dict()))
    cache = tmp_path / "cache"
    args = ["data", "prepare", "--protocol", str(path), "--root", f"ct={roots['ct']}", "--cache-dir", str(cache)]
    assert main([*args, "--workers", "2"]) == 0
    out = capsys.readouterr().out
    assert "5 sample(s) in 1 dataset(s); 0 already prepared, 5 to preprocess" in out
    assert "prepared 5 sample(s)" in out and "4 label file(s) indexed" in out and "every sample is prepared" in out
    assert len(list((cache / "real" / "store").glob("*/*/entry.json"))) == 5
    assert main([*args, "--workers", "1"]) == 0  # nothing left to do
    assert "5 already prepared, 0 to preprocess" in capsys.readouterr().out
    # a run after prepare neither preprocesses nor reads label files
    said = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(storage, "write_entry", lambda *a, **k: pytest.fail("a prepared sample was preprocessed again"))
        data, _ = load_real(protocol, roots, cache, echo=said.append)
        for i in range(len(data[0].train)):
            data[0].train.images[i]
    assert not [m for m in said if "reading" in m]


def test_prepare_one_line_errors(copy, tmp_path, capsys):
    protocol, roots = copy
    path = tmp_path / "store-proto.yaml"
    path.write_text(yaml.safe_dump(protocol_dict()))
    assert main(["data", "prepare", "--protocol", "synthetic-2d"]) == 2
    assert "synthetic protocol has no datasets to prepare" in capsys.readouterr().err
    assert main(["data", "prepare", "--protocol", str(path), "--workers", "0", "--root", f"ct={roots['ct']}"]) == 2
    assert capsys.readouterr().err.strip().endswith("--workers 0: give at least 1 worker process")
    env = {k: v for k, v in os.environ.items() if not k.startswith("JASCL_ROOT_")}
    report = prepare_protocol(protocol, cache_dir=tmp_path / "cache", environ=env, **QUIET)
    assert (
        report.problems == ["dataset root 'ct' (ct (msd)) is not set; pass --root ct=PATH or set JASCL_ROOT_CT"]
        and report.samples == 0
    )
    # a corrupt sample is one line naming its file; the others are prepared all the same
    fxm.corrupt_file(roots["ct"] / "imagesTr" / "case_001_0000.nii.gz")
    report = prepare_protocol(protocol, roots, cache_dir=tmp_path / "cache", workers=1, **QUIET)
    assert len(report.problems) == 1 and "case_001_0000.nii.gz: unreadable or corrupt NIfTI" in report.problems[0]
    assert report.built == 4
    with pytest.raises(ConfigError, match="--root nope=...: protocol store-proto has no dataset root"):
        prepare_protocol(protocol, {"nope": tmp_path}, cache_dir=tmp_path / "cache", **QUIET)


class KilledMSD(MSDLayout):
    """The msd layout, except that reading ``case_002`` kills the process while ``<root>/KILL`` exists."""

    name = "msd-killed-test"

    def read(self, record):
        if record.id == "case_002" and (self.root / "KILL").exists():
            os.kill(os.getpid(), signal.SIGKILL)
        return super().read(record)


if "msd-killed-test" not in LAYOUTS:
    LAYOUTS.register("msd-killed-test")(KilledMSD)

_DIE_WRITING = """
import os, signal, sys
from pathlib import Path
from jascl.fileio import atomic_write_dir

def write(tmp):
    (tmp / "entry.json").write_text("{}")  # a first file, then the process is killed before the rename
    os.kill(os.getpid(), signal.SIGKILL)

atomic_write_dir(Path(sys.argv[1]), write)
"""


def test_prepare_resumes_after_a_worker_is_killed(copy, tmp_path):
    data = protocol_dict()
    data["datasets"]["ct"]["layout"] = "msd-killed-test"
    protocol = parse_protocol(data, "store-proto.yaml")
    roots = copy[1]
    cache = tmp_path / "cache"
    (roots["ct"] / "KILL").touch()
    with pytest.raises(DataError, match=r"a worker process died .* run the same command again to resume"):
        prepare_protocol(protocol, roots, cache_dir=cache, workers=1, **QUIET)
    store = cache / "real" / "store"
    (roots["ct"] / "KILL").unlink()
    entries = _store(protocol, roots, cache)
    paths = {ref: entries.entry_path(f"ct/{ref}") for ref in ("case_000", "case_001", "case_002", "case_003")}
    # one worker takes the samples in order: case_000 and case_001 were complete before case_002 killed it
    assert [open_entry(p) is not None for p in paths.values()] == [True, True, False, False]
    # a process killed while writing an entry leaves a temporary folder, never a folder under the entry's name
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", _DIE_WRITING, str(paths["case_003"])], env=env)
    assert done.returncode == -signal.SIGKILL
    assert not paths["case_003"].exists() and len(list(store.glob("*/.*.tmp-*"))) == 1
    assert open_entry(paths["case_003"]) is None
    said = []
    report = prepare_protocol(protocol, roots, cache_dir=cache, workers=2, echo=said.append)
    assert (report.complete, report.built, report.problems) == (2, 3, [])
    assert "[prepare] removed 1 unfinished entr(y/ies) of interrupted runs" in said
    assert not list(store.glob("*/.*.tmp-*")) and all(open_entry(p) is not None for p in paths.values())
    # the same arrays as a store prepared in one go
    fresh = tmp_path / "fresh"
    prepare_protocol(protocol, roots, cache_dir=fresh, workers=1, **QUIET)
    entries = sorted(p.relative_to(store) for p in store.glob("*/*"))
    assert entries == sorted(p.relative_to(fresh / "real" / "store") for p in (fresh / "real" / "store").glob("*/*"))
    assert len(entries) == 5
    for rel in entries:
        a, b = _entry_arrays(store / rel), _entry_arrays(fresh / "real" / "store" / rel)
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a if a[k] is not None)
        assert (a["label"] is None) == (b["label"] is None)


# --------------------------------------------------------------------------------------------- validity


def test_a_changed_source_file_gets_a_new_entry(copy, tmp_path):
    protocol, roots = copy
    cache = tmp_path / "cache"
    store = _store(protocol, roots, cache)
    before_path = store.entry_path("ct/case_000")
    _, before = store.load("ct/case_000")
    label_file = roots["ct"] / "labelsTr" / "case_000.nii.gz"
    fxm.rewrite_volume(label_file, lambda d: np.zeros_like(d))
    os.utime(label_file, ns=(10**18, 10**18))  # a new time as well as new content
    store = _store(protocol, roots, cache)
    assert store.entry_path("ct/case_000") != before_path
    _, after = store.load("ct/case_000")
    assert before.max() > 0 and after.max() == 0
    after_path = store.entry_path("ct/case_000")
    os.utime(label_file, ns=(10**18 + 1, 10**18 + 1))  # touched only: a new entry too
    assert _store(protocol, roots, cache).entry_path("ct/case_000") not in (before_path, after_path)


def test_old_format_and_damaged_entries_are_rebuilt_not_misread(copy, tmp_path):
    protocol, roots = copy
    cache = tmp_path / "cache"
    store = _store(protocol, roots, cache)
    source = store.sources["ct"]
    record = source.records["case_000"]
    # what the earlier versions wrote for this sample (an .npz under real/samples, the same key parts), here bogus
    old_key = [1, "msd", list(record.files), {}, {"intensity": "ct"}, 3]
    bogus = (np.full((1, *SHAPE), 7.0, np.float32), np.full(SHAPE, 9, np.uint8))
    cached(old_key, lambda: bogus, cache / "real" / "samples")
    assert len(list((cache / "real" / "samples").rglob("*.npz"))) == 1
    image, label = store.load("ct/case_000")
    assert not (image == 7.0).all() and set(np.unique(label)) <= {0, 1, 2}
    reference = (image.copy(), label.copy())
    path = store.entry_path("ct/case_000")
    # an entry of another store version under the same name: removed and rebuilt
    info = json.loads((path / "entry.json").read_text())
    (path / "entry.json").write_text(json.dumps({**info, "version": 0}))
    again = _store(protocol, roots, cache).load("ct/case_000")
    assert json.loads((path / "entry.json").read_text())["version"] == store_module.STORE_VERSION
    assert np.array_equal(again[0], reference[0]) and np.array_equal(again[1], reference[1])
    # a truncated array file: rebuilt
    data = (path / "image.npy").read_bytes()
    (path / "image.npy").write_bytes(data[: len(data) // 2])
    again = _store(protocol, roots, cache).load("ct/case_000")
    assert np.array_equal(again[0], reference[0])
    # the arrays equal preprocessing the files now
    nii = nib.load(str(record.label))
    assert np.array_equal(np.sort(np.unique(np.asarray(nii.dataobj))), np.unique(reference[1]))


@pytest.mark.parametrize("earlier_version", [1, 2])
def test_entries_of_an_earlier_preprocessing_version_are_not_read_and_can_be_removed(
    copy, tmp_path, monkeypatch, capsys, earlier_version
):
    """Volume preprocessing version 3 (resampling axis by axis, since version 2 resampled in float32) is part of
    every volume entry's key and recorded in the entry; version-2 entries (which record 2) and version-1 entries
    (which do not record it) are not found, are counted by prepare, and removed on request; 2D entries keep
    version 1."""
    from jascl.data import prepare as prepare_module
    from jascl.data.real import storage

    protocol, roots = copy
    cache = tmp_path / "cache"
    store = _store(protocol, roots, cache)
    current = store.entry_path("ct/case_000")
    store.load("ct/case_000")
    made_from = json.loads((current / "entry.json").read_text())["made_from"]
    assert PREPROCESS_VERSIONS == {2: 1, 3: 3} and made_from["preprocess_version"] == 3
    monkeypatch.setattr(storage, "PREPROCESS_VERSIONS", {2: 1, 3: earlier_version})
    earlier = _store(protocol, roots, cache)
    old = earlier.entry_path("ct/case_000")
    assert old != current
    earlier.load("ct/case_000")
    info = json.loads((old / "entry.json").read_text())
    assert info["made_from"]["preprocess_version"] == earlier_version
    if earlier_version == 1:  # what version 1 wrote: an entry without the field
        del info["made_from"]["preprocess_version"]
        (old / "entry.json").write_text(json.dumps(info))
    monkeypatch.undo()
    assert prepare_module.outdated_entries(cache) == [old]
    lines = []
    prepare_module._remove_outdated(cache, False, lines.append)
    assert old.is_dir() and lines == [
        f"[prepare] note: the store holds 1 entr(y/ies) ({_gib(old)}) made by an earlier version of the "
        "preprocessing, which this version no longer reads; add --remove-outdated to delete them"
    ]
    path = tmp_path / "store-proto.yaml"
    path.write_text(yaml.safe_dump(protocol_dict()))
    args = ["data", "prepare", "--protocol", str(path), "--root", f"ct={roots['ct']}", "--cache-dir", str(cache)]
    assert main([*args, "--workers", "1", "--remove-outdated"]) == 0
    assert "[prepare] removed 1 entr(y/ies) of an earlier preprocessing version" in capsys.readouterr().out
    assert not old.exists() and current.is_dir() and prepare_module.outdated_entries(cache) == []


def _gib(folder):
    return f"{sum(f.stat().st_size for f in folder.iterdir()) / 2**30:.2f} GiB"
