"""``jascl data check``: every kind of problem is one line and exit 2; a sound copy passes with a summary."""

import contextlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fixtures import medical as fxm  # noqa: E402
from fixtures import natural as fxn  # noqa: E402
from jascl.cli import main  # noqa: E402
from jascl.data.check import check_protocol  # noqa: E402
from jascl.protocols import parse_protocol  # noqa: E402

SHAPE = (12, 12, 8)


def protocol_dict(shots: int = 2, unlabelled: int = 2, ct_labels=None) -> dict:
    """Two CT-like MSD datasets: 'ct' teaches classes 1, 2 (base), 'mr' teaches class 3 (K-shot, unlabelled pool)."""
    return {
        "name": "check-proto",
        "seed": 1024,
        "spatial_dims": 3,
        "in_channels": 1,
        "metric": "dice",
        "classes": [
            {"id": 0, "name": "background"},
            {"id": 1, "name": "liver"},
            {"id": 2, "name": "spleen"},
            {"id": 3, "name": "tumour"},
        ],
        "domains": {"ct": {}, "mr": {}},
        "datasets": {
            "ct": {
                "layout": "msd",
                "domain": "ct",
                "labels": ct_labels or {1: "liver", 2: "spleen"},
                "preprocess": {"intensity": "ct"},
            },
            "mr": {"layout": "msd", "domain": "mr", "labels": {1: "tumour"}, "preprocess": {"intensity": "ct"}},
        },
        "sessions": [
            {"name": "base", "domains": ["ct"], "new_classes": [1, 2], "shots": "all", "sources": ["ct"]},
            {
                "name": "tumour",
                "domains": ["mr"],
                "new_classes": [3],
                "shots": shots,
                "unlabelled": unlabelled,
                "sources": ["mr"],
            },
        ],
        "training": {"patch_size": [32, 32, 32]},  # the smallest the default U-Net takes; volumes are padded
    }


def write_copies(tmp_path: Path, ct_cases: int = 4, mr_cases: int = 5, mr_test: int = 2) -> dict[str, Path]:
    return {
        "ct": fxm.write_msd(tmp_path / "ct", cases=ct_cases, shape=SHAPE, labels=(1, 2), test_cases=0),
        "mr": fxm.write_msd(tmp_path / "mr", cases=mr_cases, shape=SHAPE, labels=(1,), test_cases=mr_test, seed=1),
    }


def run_check(tmp_path: Path, capsys, data: dict, roots: dict[str, Path]) -> tuple[int, list[str], list[str]]:
    path = tmp_path / "check-proto.yaml"
    path.write_text(yaml.safe_dump(data))
    args = ["data", "check", "--protocol", str(path), "--cache-dir", str(tmp_path / "cache")]
    for name, root in roots.items():
        args += ["--root", f"{name}={root}"]
    code = main(args)
    out = capsys.readouterr().out.splitlines()
    return code, out, [line for line in out if line.startswith("error: ")]


def test_good_copy_passes_with_a_per_session_summary(tmp_path, capsys, monkeypatch):
    from jascl.data import check, heap

    # the command checks inside jascl.data.heap's block (each volume reuses the last one's pages), not around it
    kept, inside = [False], []

    @contextlib.contextmanager
    def recording():
        kept[0] = True
        yield True
        kept[0] = False

    real_check = check.check_protocol
    monkeypatch.setattr(heap, "freed_memory_kept", recording)
    monkeypatch.setattr(check, "check_protocol", lambda *a, **k: inside.append(kept[0]) or real_check(*a, **k))
    code, out, errors = run_check(tmp_path, capsys, protocol_dict(), write_copies(tmp_path))
    assert inside == [True] and kept == [False]
    assert code == 0 and errors == [], out
    # ct: 4 cases, a fifth (round(0.2 * 4) = 1) held out for testing; mr: 5 cases, 1 test, K=2 shots (every
    # case shows the tumour), the unlabelled pool takes 2 of the 2 remaining training cases + 2 imagesTs cases
    assert "  0 base [ct]: classes 1:liver, 2:spleen; shots all; labelled 3, unlabelled 0, test 1" in out
    assert "  1 tumour [mr]: classes 3:tumour; shots 2; labelled 2, unlabelled 2, test 1" in out
    assert any(line.startswith("  ct (msd) at ") and "4 samples, training pool 3, test pool 1" in line for line in out)
    assert any(
        line.startswith("  mr (msd) at ") and "7 samples, training pool 4, test pool 1, without labels 2" in line
        for line in out
    )
    assert out[-1] == "no problems found"


def _one_problem(tmp_path, capsys, data, roots, *fragments):
    code, out, errors = run_check(tmp_path, capsys, data, roots)
    assert code == 2, out
    assert len(errors) == 1, errors
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    assert out[-1] == "1 problem(s) found"
    return errors[0]


def test_missing_file(tmp_path, capsys):
    roots = write_copies(tmp_path)
    label = fxm.remove_file(roots["ct"] / "labelsTr" / "case_001.nii.gz")
    _one_problem(tmp_path, capsys, protocol_dict(), roots, str(label), "missing label")


def test_corrupt_nifti(tmp_path, capsys):
    roots = write_copies(tmp_path)
    image = fxm.corrupt_file(roots["ct"] / "imagesTr" / "case_002_0000.nii.gz")
    _one_problem(tmp_path, capsys, protocol_dict(), roots, str(image), "unreadable or corrupt NIfTI")


def test_image_label_shape_mismatch(tmp_path, capsys):
    roots = write_copies(tmp_path)
    label = fxm.write_wrong_shape(roots["ct"] / "labelsTr" / "case_000.nii.gz")
    _one_problem(tmp_path, capsys, protocol_dict(), roots, str(label), "shape (12, 12, 7) differs", "(12, 12, 8)")


def test_affine_mismatch(tmp_path, capsys):
    roots = write_copies(tmp_path)
    label = fxm.write_wrong_affine(roots["ct"] / "labelsTr" / "case_002.nii.gz", shift=5.0)
    _one_problem(tmp_path, capsys, protocol_dict(), roots, str(label), "affine differs", "5")


def test_label_value_outside_the_map(tmp_path, capsys):
    roots = write_copies(tmp_path)
    label = fxm.write_label_value(roots["ct"] / "labelsTr" / "case_001.nii.gz", 7)
    _one_problem(tmp_path, capsys, protocol_dict(), roots, str(label), "label value(s) [7]")


def test_protocol_maps_a_label_the_dataset_does_not_have(tmp_path, capsys):
    roots = write_copies(tmp_path)
    line = _one_problem(
        tmp_path,
        capsys,
        protocol_dict(ct_labels={1: "liver", 2: "spleen", 9: "spleen"}),
        roots,
        "datasets.ct.labels.9",
        "native label 9 is not a label of the msd dataset",
    )
    assert "(its labels: 0, 1, 2)" in line


def test_fewer_than_k_samples_of_a_class(tmp_path, capsys):
    roots = write_copies(tmp_path)  # mr: 4 training cases
    _one_problem(
        tmp_path,
        capsys,
        protocol_dict(shots=5, unlabelled=0),
        roots,
        "session 1 (tumour)",
        "class 3 (tumour) is in only 4 training sample(s) of mr",
        "K=5",
    )


def test_empty_unlabelled_pool_that_the_protocol_requires(tmp_path, capsys):
    roots = write_copies(tmp_path, mr_cases=3, mr_test=0)  # 1 test, 2 training cases, both labelled shots
    _one_problem(
        tmp_path,
        capsys,
        protocol_dict(shots=2, unlabelled=4),
        roots,
        "session 1 (tumour)",
        "asks for an unlabelled pool",
        "none of mr has samples left",
    )


def test_smaller_unlabelled_pool_is_a_warning(tmp_path, capsys):
    code, out, errors = run_check(tmp_path, capsys, protocol_dict(unlabelled=10), write_copies(tmp_path))
    assert code == 0 and errors == []
    assert "warning: session 1 (tumour): 4 unlabelled of 10 requested" in out


def test_unset_root_and_unreadable_root(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("JASCL_ROOT_MR", raising=False)
    roots = write_copies(tmp_path)
    code, out, errors = run_check(tmp_path, capsys, protocol_dict(), {"ct": roots["ct"]})
    assert code == 2 and len(errors) == 1
    assert "dataset root 'mr'" in errors[0] and "--root mr=PATH" in errors[0] and "JASCL_ROOT_MR" in errors[0]
    assert "  1 tumour: not checked (dataset(s) mr unavailable)" in out
    code, out, errors = run_check(tmp_path, capsys, protocol_dict(), {"ct": roots["ct"], "mr": tmp_path / "nowhere"})
    assert code == 2 and len(errors) == 1 and "dataset mr:" in errors[0] and "nowhere" in errors[0]


def test_corrupt_png_in_a_2d_copy(tmp_path, capsys):
    root = fxn.write_bdd100k(tmp_path / "bdd", per_split=3, classes=(0, 13))
    data = {
        "name": "bdd-check",
        "spatial_dims": 2,
        "in_channels": 3,
        "classes": [{"id": 0, "name": "background"}, {"id": 1, "name": "road"}, {"id": 2, "name": "car"}],
        "domains": {"bdd": {}},
        "datasets": {
            "bdd": {"layout": "bdd100k", "domain": "bdd", "labels": {0: "road", 13: "car"}, "test_splits": ["val"]}
        },
        "sessions": [
            {"name": "base", "domains": ["bdd"], "new_classes": [1], "shots": "all", "sources": ["bdd"]},
            {"name": "car", "domains": ["bdd"], "new_classes": [2], "shots": 2, "sources": ["bdd"]},
        ],
    }
    code, out, errors = run_check(tmp_path, capsys, data, {"bdd": root})
    assert code == 0, out
    assert "  1 car [bdd]: classes 2:car; shots 2; labelled 2, unlabelled 0, test 3" in out
    image = sorted((root / "images" / "10k" / "val").glob("*.jpg"))[0]
    fxn.corrupt_file(image)
    code, out, errors = run_check(tmp_path, capsys, data, {"bdd": root})
    assert code == 2 and len(errors) == 1 and str(image) in errors[0]
    assert "  1 car [bdd]: classes 2:car; shots 2; labelled 2, unlabelled 0, test 2" in out
    # a blank (constant) frame, as JPEG, in the training split
    from PIL import Image

    blank = sorted((root / "images" / "10k" / "train").glob("*.jpg"))[0]
    size = Image.open(blank).size
    Image.new("RGB", size, (0, 0, 0)).save(blank)
    code, out, errors = run_check(tmp_path, capsys, data, {"bdd": root})
    assert code == 2 and len(errors) == 2, errors
    assert any(
        e.startswith(f"error: {blank}: image is constant (every value is 0); the file holds no image") for e in errors
    )


def test_synthetic_protocol_is_refused(capsys):
    assert main(["data", "check", "--protocol", "synthetic-2d"]) == 2
    assert "synthetic protocol has no dataset copies" in capsys.readouterr().err


def test_check_protocol_api_collects_instead_of_raising(tmp_path):
    roots = write_copies(tmp_path, mr_cases=3, mr_test=0)
    report = check_protocol(
        parse_protocol(protocol_dict(shots=3, unlabelled=1), "p.yaml"),
        roots,
        cache_dir=tmp_path / "cache",
        echo=lambda *a: None,
    )
    assert not report.ok
    assert [p.split(":", 2)[1].strip() for p in report.problems] == ["session 1 (tumour)", "session 1 (tumour)"]
    assert "fewer than shots K=3" in report.problems[0] and "unlabelled pool" in report.problems[1]
    assert report.sessions[1]["labelled"] == 2 and report.sessions[1]["test"] == 1


def test_builtin_med_ss_passes_on_fixture_copies(tmp_path, capsys):
    from jascl.protocols import get_protocol
    from test_real_protocols import write_medical_roots

    protocol = get_protocol("med-ss")
    roots = write_medical_roots(tmp_path / "data", protocol)
    args = ["data", "check", "--protocol", "med-ss", "--cache-dir", str(tmp_path / "cache")]
    for name, root in roots.items():
        args += ["--root", f"{name}={root}"]
    assert main(args) == 0
    out = capsys.readouterr().out.splitlines()
    assert (
        "  1 amos [amos]: classes 16:pancreas, 17:duodenum, 18:bladder, 19:prostate_uterus, 20:postcava; "
        "shots 5; labelled 5, unlabelled 3, test 1" in out
    )  # 7 cases: 1 held out, 5 shots, 1 + 2 imagesTs left
    assert "warning: session 1 (amos): 3 unlabelled of 25 requested" in out
    assert out[-1] == "no problems found"


# --- defects that break training (issue 20, item 1), each one line naming the file and the fix ----------------


def _set_first(value):
    def change(data):
        data.flat[0] = value
        return data

    return change


def test_nan_voxel_in_an_image(tmp_path, capsys):
    roots = write_copies(tmp_path)
    image = fxm.rewrite_volume(roots["ct"] / "imagesTr" / "case_001_0000.nii.gz", _set_first(np.nan), np.float32)
    line = _one_problem(
        tmp_path, capsys, protocol_dict(), roots, str(image), "image holds 1 non-finite value(s) (NaN or +-inf)"
    )
    assert line.endswith(
        f"out of {12 * 12 * 8}; replace them (e.g. numpy.nan_to_num) and save the file again, or drop the sample"
    )


def test_infinite_values_in_an_image(tmp_path, capsys):
    roots = write_copies(tmp_path)
    path = roots["mr"] / "imagesTr" / "case_002_0000.nii.gz"
    image = fxm.rewrite_volume(path, lambda d: np.where(d > 0, np.inf, d), np.float32)
    count = int((np.asarray(fxm.nib.load(str(image)).dataobj) == np.inf).sum())
    assert count > 1
    _one_problem(tmp_path, capsys, protocol_dict(), roots, str(image), f"image holds {count} non-finite value(s)")


def test_constant_image(tmp_path, capsys):
    roots = write_copies(tmp_path)
    image = fxm.rewrite_volume(roots["ct"] / "imagesTr" / "case_000_0000.nii.gz", lambda d: np.zeros_like(d))
    _one_problem(
        tmp_path, capsys, protocol_dict(), roots, str(image), "image is constant (every value is 0)", "re-export"
    )


def test_implausible_spacing(tmp_path, capsys):
    roots = write_copies(tmp_path)
    affine = fxm.fixture_affine(SHAPE)
    affine[2, 2] = 25.0  # 25 mm slices: a header error, not a CT
    image = fxm.rewrite_volume(roots["ct"] / "imagesTr" / "case_002_0000.nii.gz", lambda d: d, affine=affine)
    fxm.rewrite_volume(roots["ct"] / "labelsTr" / "case_002.nii.gz", lambda d: d, affine=affine)  # same grid
    _one_problem(
        tmp_path, capsys, protocol_dict(), roots, str(image), "implausible voxel spacing (1.5, 1.5, 25.0) mm", "pixdim"
    )


def test_four_dimensional_channel_file_and_label(tmp_path, capsys):
    roots = write_copies(tmp_path)
    image = fxm.rewrite_volume(roots["ct"] / "imagesTr" / "case_001_0000.nii.gz", lambda d: np.stack([d, d], axis=-1))
    _one_problem(
        tmp_path,
        capsys,
        protocol_dict(),
        roots,
        str(image),
        "image is 4D (12, 12, 8, 2) with 2 channel(s); the dataset declares 1 (CT)",
    )
    roots = write_copies(tmp_path / "again")
    label = fxm.rewrite_volume(
        roots["mr"] / "labelsTr" / "case_000.nii.gz", lambda d: np.stack([d == 0, d == 1], -1).astype(np.uint8)
    )
    _one_problem(tmp_path, capsys, protocol_dict(), roots, str(label), "label is 4D (12, 12, 8, 2)", "one 3D volume")


def test_float_label_with_fractions(tmp_path, capsys):
    roots = write_copies(tmp_path)
    label = fxm.rewrite_volume(roots["ct"] / "labelsTr" / "case_000.nii.gz", _set_first(0.5), np.float32)
    _one_problem(tmp_path, capsys, protocol_dict(), roots, str(label), "label holds non-integer values")


def test_a_training_sample_with_only_background_is_a_warning(tmp_path, capsys):
    roots = write_copies(tmp_path)
    label = fxm.rewrite_volume(roots["ct"] / "labelsTr" / "case_000.nii.gz", lambda d: np.zeros_like(d))
    code, out, errors = run_check(tmp_path, capsys, protocol_dict(), roots)
    assert code == 0 and errors == [], out
    assert (
        f"warning: {label}: label holds only background, so no session of the protocol uses this sample of "
        "dataset ct; fix the label file if it should show classes, or drop the sample"
    ) in out
    # the base session takes every training case that shows a class: 2 of the pool of 3
    assert "  0 base [ct]: classes 1:liver, 2:spleen; shots all; labelled 2, unlabelled 0, test 1" in out


def test_run_refuses_a_nan_sample_with_the_check_line_and_never_trains(tmp_path, capsys):
    roots = write_copies(tmp_path)
    image = fxm.rewrite_volume(roots["ct"] / "imagesTr" / "case_001_0000.nii.gz", _set_first(np.inf), np.float32)
    path = tmp_path / "check-proto.yaml"
    path.write_text(yaml.safe_dump(protocol_dict()))
    tiny = {"backbone_args": {"features": [4, 4, 8, 8, 8, 8]}, "epochs_base": 1, "epochs_incremental": 1}
    tiny["patch_size"] = [32, 32, 32]
    args = ["run", "--protocol", str(path), "--out", str(tmp_path / "run"), "--cache-dir", str(tmp_path / "cache")]
    args += ["--no-progress", "--methods", "vanilla", *(f"--set={k}={json.dumps(v)}" for k, v in tiny.items())]
    args += [f"--root={name}={root}" for name, root in roots.items()]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"{image}: image holds 1 non-finite value(s) (NaN or +-inf)" in err
    assert "found while loading it for training; 'jascl data check' lists all" in err
    assert not list((tmp_path / "run").rglob("*.safetensors"))  # nothing was trained


def test_check_sample_values_names_the_channel_file():
    from jascl.data.layouts import Record
    from jascl.data.real.storage import check_sample_values
    from jascl.errors import DataError

    record = Record("c", (Path("c_0000.nii.gz"), Path("c_0001.nii.gz")), None)
    image = np.random.default_rng(0).normal(size=(2, 4, 4, 4)).astype(np.float32)
    check_sample_values(record, image)  # sound: no error
    image[1, 0, 0, 0] = np.nan
    with pytest.raises(DataError, match=r"^c_0001\.nii\.gz: image holds 1 non-finite value\(s\)"):
        check_sample_values(record, image)
    image[1] = 3.0
    with pytest.raises(DataError, match=r"^c_0001\.nii\.gz: image is constant \(every value is 3\)"):
        check_sample_values(record, image)
    one_file = Record("d", (Path("d.nii.gz"),), None)  # a 4D file: the channel is named
    with pytest.raises(DataError, match=r"^d\.nii\.gz: image channel 1 is constant"):
        check_sample_values(one_file, image)
