"""Data that passed ``jascl data check`` and then crashed ``jascl run`` (issue 35): small volumes, geometry in the
affine resampling uses, a header that claims 2000^3 voxels, and the MSD layout's smaller defects. Every refusal is
one line, exit 2, and a run that refuses leaves no folder behind."""

import gzip
import io
import json
import sys
import time
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fixtures import medical as fxm  # noqa: E402
from jascl.cli import main  # noqa: E402
from jascl.data.geometry import affine_problem, planned_shape, planned_shape_problem  # noqa: E402
from jascl.networks.base import create_segmenter  # noqa: E402

TINY = {"features": [4, 4, 4, 4, 4, 4]}  # a BasicUNet of four 2x poolings with 4 channels: fast on a CPU


def protocol(patch, spacing=None, **training) -> dict:
    preprocess = {"intensity": "ct", **({"spacing": spacing} if spacing else {})}
    return {
        "name": "first-hour",
        "seed": 1,
        "spatial_dims": 3,
        "in_channels": 1,
        "metric": "dice",
        "classes": [{"id": 0, "name": "background"}, {"id": 1, "name": "liver"}, {"id": 2, "name": "spleen"}],
        "domains": {"ct": {}},
        "datasets": {
            "d": {"layout": "msd", "domain": "ct", "labels": {1: "liver", 2: "spleen"}, "preprocess": preprocess}
        },
        "sessions": [
            {"name": "base", "domains": ["ct"], "new_classes": [1], "shots": "all", "sources": ["d"]},
            {"name": "spleen", "domains": ["ct"], "new_classes": [2], "shots": 1, "sources": ["d"]},
        ],
        "training": {
            "patch_size": list(patch),
            "backbone_args": TINY,
            "epochs_base": 1,
            "epochs_incremental": 1,
            "batch_size": 2,
            "threads": 1,
            **training,
        },
    }


def write(tmp_path: Path, spec: dict) -> Path:
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def check(tmp_path, capsys, spec, root) -> tuple[int, list[str], list[str]]:
    code = main(
        ["data", "check", "--protocol", str(write(tmp_path, spec)), "--root", f"d={root}"]
        + ["--cache-dir", str(tmp_path / "cache")]
    )
    out = capsys.readouterr().out.splitlines()
    return (
        code,
        [line for line in out if line.startswith("error: ")],
        [line for line in out if line.startswith(("warning: ", "note: "))],
    )


def run(tmp_path, capsys, spec, root, out: Path) -> tuple[int, str]:
    threads = torch.get_num_threads()
    try:
        code = main(
            ["run", "--protocol", str(write(tmp_path, spec)), "--root", f"d={root}", "--methods", "vanilla"]
            + ["--out", str(out), "--cache-dir", str(tmp_path / "cache"), "--no-progress"]
        )
    finally:
        torch.set_num_threads(threads)
    return code, capsys.readouterr().err


def one_line_refusal(code: int, err: str) -> str:
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("jascl: error: "), err
    assert "Traceback" not in err
    return lines[0]


def rewrite_header(path: Path, edit) -> None:
    """Save ``path`` again with ``edit(header)`` applied to its header as is (nibabel does not re-derive the sform
    from an affine: the file keeps what ``edit`` wrote, as a broken converter would)."""
    img = nib.load(str(path))
    header = img.header.copy()
    edit(header)
    nib.save(nib.Nifti1Image(np.asarray(img.dataobj), None, header=header), str(path))


def break_case(root: Path, case: str, edit) -> Path:
    image = root / "imagesTr" / f"{case}_0000.nii.gz"
    for path in (image, root / "labelsTr" / f"{case}.nii.gz"):  # image and label keep one grid
        rewrite_header(path, edit)
    return image


# --- small volumes --------------------------------------------------------------------------------------------


def test_small_volumes_are_padded_for_every_forward_and_train(tmp_path, capsys):
    """24^3 volumes with a 32^3 patch: the check says they are padded (no problem), and the run trains and
    evaluates them (it died at the 1 x 1 x 1 bottom level of the U-Net computing prototypes on whole volumes)."""
    root = fxm.write_msd(tmp_path / "d", cases=4, shape=(24, 24, 24), test_cases=0)
    code, errors, warnings = check(tmp_path, capsys, protocol([32, 32, 32]), root)
    assert code == 0 and errors == []
    (line,) = [w for w in warnings if "smaller than patch_size" in w]
    assert "4 volume(s) are smaller than patch_size [32, 32, 32]" in line and "24 x 24 x 24" in line
    code, err = run(tmp_path, capsys, protocol([32, 32, 32]), root, tmp_path / "run")
    assert code == 0, err
    assert (tmp_path / "run" / "results.json").is_file()


@pytest.mark.parametrize(
    ("backbone", "size", "padded"),
    [
        ("unet", (24, 24, 24), (32, 24, 24)),  # a 1 x 1 x 1 bottom level: the shortest axis doubles to 32
        ("unet", (17, 40, 40), (17, 40, 40)),  # floor(17/16) x 2 x 2 = 4 bottom voxels: taken as it is
        ("unet", (8, 64, 64), (16, 64, 64)),  # 8 < 16: four poolings would leave nothing
        ("monai-unet", (40, 40, 40), (64, 64, 64)),  # strided convolutions need multiples of 32, at least 64
    ],
)
def test_whole_samples_are_padded_to_what_the_backbone_takes_and_cropped_back(backbone, size, padded):
    model = create_segmenter(backbone, 3, 1, 3, **(TINY if backbone == "unet" else {})).eval()
    assert model.backbone.input_size(size) == padded
    with torch.no_grad():
        out = model.forward_features(torch.randn(1, 1, *size))
    assert tuple(out.logits.shape) == (1, 3, *size)
    assert tuple(out.features.shape[2:]) == size  # features at input resolution, cropped to the input


def test_a_patch_the_backbone_cannot_take_is_refused_by_check_and_run(tmp_path, capsys):
    root = fxm.write_msd(tmp_path / "d", cases=3, shape=(24, 24, 24), test_cases=0)
    spec = protocol([16, 16, 16])
    code, errors, _ = check(tmp_path, capsys, spec, root)
    assert code == 2
    assert [e for e in errors if "patch_size=[16, 16, 16]" in e and "the smallest that works here: [32, 32, 32]" in e]
    code, err = run(tmp_path, capsys, spec, root, tmp_path / "run")
    assert "the smallest that works here: [32, 32, 32]" in one_line_refusal(code, err)
    assert not (tmp_path / "run").exists()  # refused before any work: no folder


# --- geometry -------------------------------------------------------------------------------------------------


def nan_sform(h):
    h["srow_x"] = [-1.5, np.nan, 0.0, 24.0]


def zero_sform(h):
    h["srow_x"] = [0.0, 0.0, 0.0, 24.0]  # axis 0 of zero length; pixdim still says 1.5 mm


def thin_voxels(h):
    affine = np.diag([0.01, 0.01, 2.0, 1.0])
    h.set_sform(affine, code=1)
    h.set_qform(affine, code=1)


@pytest.mark.parametrize(
    ("edit", "spacing", "message"),
    [
        (nan_sform, None, "the affine (sform/qform used for resampling) holds NaN or infinite values"),
        (zero_sform, None, "the affine's voxel spacing 0 x 1.5 x 2 mm is zero"),
        (
            thin_voxels,
            [1.5, 1.5, 2.0],
            "resampling to datasets.d.preprocess.spacing [1.5, 1.5, 2.0] mm would leave 1 x 1 x 24 voxels",
        ),
    ],
    ids=["nan-in-sform", "zero-spacing-in-sform", "0.01mm-voxels"],
)
def test_geometry_of_the_affine_resampling_uses(tmp_path, capsys, edit, spacing, message):
    """Each passed the check (it read the repaired pixdim) and crashed inside MONAI or torch."""
    root = fxm.write_msd(tmp_path / "d", cases=4, shape=(24, 24, 24), test_cases=0)
    image = break_case(root, "case_001", edit)
    spec = protocol([32, 32, 32], spacing)
    code, errors, _ = check(tmp_path, capsys, spec, root)
    assert code == 2 and len(errors) == 1
    assert errors[0].startswith(f"error: {image}: ") and message in errors[0], errors
    code, err = run(tmp_path, capsys, spec, root, tmp_path / "run")
    line = one_line_refusal(code, err)
    assert str(image) in line and message in line
    assert not (tmp_path / "run").exists()  # found from the headers before training: nothing left behind


def test_planned_shape_follows_monai_orientation_and_spacing():
    """Hand-computed as MONAI's Spacing does: the voxel centres span (n - 1) x spacing mm, and the new shape is that
    extent over the target spacing, + 1, rounded half to even. The fixture's LPS-like affine (-1.5, -1.5, 2)
    reoriented to RAS keeps a 24^3 shape; to 3 x 3 x 1 mm: 23 x 1.5 / 3 + 1 = 12.5 -> 12, 23 x 2 / 1 + 1 = 47."""
    from jascl.data.layouts.base import Sample
    from jascl.data.medical import preprocess_volume

    affine = fxm.fixture_affine((24, 24, 24))
    assert planned_shape((24, 24, 24), affine, "RAS", None) == (24, 24, 24)
    assert planned_shape((24, 24, 24), affine, "RAS", [3.0, 3.0, 1.0]) == (12, 12, 47)
    permuted = affine[:, [2, 0, 1, 3]]  # voxel axes stored as (S, R, A): reorientation permutes the shape
    assert planned_shape((10, 20, 30), permuted, "RAS", None) == (20, 30, 10)
    # 19 x 1.5 / 3 + 1 = 10.5 -> 10, 29 x 1.5 / 3 + 1 = 15.5 -> 16, 9 x 2 / 1 + 1 = 19; MONAI gives the same
    assert planned_shape((10, 20, 30), permuted, "RAS", [3.0, 3.0, 1.0]) == (10, 16, 19)
    sample = Sample(np.zeros((1, 10, 20, 30), np.float32), None, permuted, {"modality": "CT"})
    image, _ = preprocess_volume(sample, {"spacing": [3.0, 3.0, 1.0], "intensity": "none"})
    assert image.shape[1:] == (10, 16, 19)


@pytest.mark.parametrize(
    ("affine", "bad"),
    [
        (np.diag([1.5, 1.5, 2.0, 1.0]), None),
        (np.diag([1.5, 1.5, 25.0, 1.0]), "over 20 mm"),
        (np.diag([1.5, 0.0, 2.0, 1.0]), "zero"),
        (np.array([[1.0, 1.0, 0, 0], [0, 0, 0, 0], [0, 0, 2.0, 0], [0, 0, 0, 1.0]]), "do not span three"),
        (np.full((4, 4), np.inf), "NaN or infinite"),
    ],
)
def test_affine_problem(affine, bad):
    found = affine_problem(affine)
    assert (found is None) if bad is None else (bad in found)


def test_a_volume_that_resampling_would_inflate_past_the_limit(monkeypatch):
    monkeypatch.setenv("JASCL_MAX_VOXELS", "1000")
    wrong, planned = planned_shape_problem((10, 10, 10), np.diag([2.0, 2.0, 2.0, 1.0]), {"spacing": [1.0, 1.0, 1.0]})
    # 9 x 2 / 1 + 1 = 19 voxels per axis: 6,859 > 1,000
    assert planned == (19, 19, 19) and "19 x 19 x 19 voxels, over the limit of 1,000" in wrong


# --- a header that claims 2000^3 voxels -----------------------------------------------------------------------


def claim_shape(path: Path, shape: tuple[int, ...]) -> None:
    """Rewrite the ``dim`` field of a gzipped NIfTI header, leaving its (small) data as it is."""
    raw = gzip.decompress(path.read_bytes())
    header = nib.Nifti1Header.from_fileobj(io.BytesIO(raw))
    header.set_data_shape(shape)
    path.write_bytes(gzip.compress(header.binaryblock + raw[len(header.binaryblock) :]))


def test_a_header_claiming_2000_cubed_voxels_is_refused_from_the_header_alone(tmp_path, capsys):
    root = fxm.write_msd(tmp_path / "d", cases=3, shape=(24, 24, 24), test_cases=0)
    image = root / "imagesTr" / "case_001_0000.nii.gz"
    claim_shape(image, (2000, 2000, 2000))
    started = time.perf_counter()
    code, errors, _ = check(tmp_path, capsys, protocol([32, 32, 32]), root)
    assert time.perf_counter() - started < 60  # nothing allocated: it was a 16 GB MemoryError at the end
    assert code == 2
    (line,) = [e for e in errors if str(image) in e]
    assert "declares 2000 x 2000 x 2000 voxels (14.9 GiB of int16)" in line and "truncated" in line
    code, err = run(tmp_path, capsys, protocol([32, 32, 32]), root, tmp_path / "run")
    assert "declares 2000 x 2000 x 2000 voxels" in one_line_refusal(code, err)
    assert not (tmp_path / "run").exists()


def test_a_header_over_the_voxel_limit(tmp_path, monkeypatch):
    from jascl.data.geometry import header_size_problem

    path = tmp_path / "v.nii"
    nib.save(nib.Nifti1Image(np.zeros((20, 20, 20), np.uint8), np.eye(4)), str(path))
    assert header_size_problem(path, nib.load(str(path))) is None
    monkeypatch.setenv("JASCL_MAX_VOXELS", "7999")
    assert "(8,000 per channel), over the limit of 7,999" in header_size_problem(path, nib.load(str(path)))


# --- the MSD layout's smaller defects -------------------------------------------------------------------------


def test_dataset_json_with_a_byte_order_mark_is_read(tmp_path, capsys):
    root = fxm.write_msd(tmp_path / "d", cases=3, shape=(32, 32, 32), test_cases=0)
    meta = root / "dataset.json"
    meta.write_bytes(b"\xef\xbb\xbf" + meta.read_bytes())
    code, errors, _ = check(tmp_path, capsys, protocol([32, 32, 32]), root)
    assert code == 0 and errors == []


def test_a_case_listed_twice_is_used_once_with_a_warning(tmp_path, capsys):
    root = fxm.write_msd(tmp_path / "d", cases=3, shape=(32, 32, 32), test_cases=0)
    meta = json.loads((root / "dataset.json").read_text())
    meta["training"].append(dict(meta["training"][1]))
    (root / "dataset.json").write_text(json.dumps(meta))
    code, errors, warnings = check(tmp_path, capsys, protocol([32, 32, 32]), root)
    assert code == 0 and errors == []
    assert warnings == [
        f"warning: {root / 'dataset.json'}: 'training' lists case case_001 (./imagesTr/case_001.nii.gz) more than "
        "once; it is used once (remove the repeated entry)"
    ]


def test_an_image_symlink_to_itself_is_named_a_symlink_loop(tmp_path, capsys):
    root = fxm.write_msd(tmp_path / "d", cases=3, shape=(32, 32, 32), test_cases=0)
    image = root / "imagesTr" / "case_002_0000.nii.gz"
    image.unlink()
    image.symlink_to(image.name)
    code, errors, _ = check(tmp_path, capsys, protocol([32, 32, 32]), root)
    assert code == 2
    assert errors == [
        f"error: {image}: image is unreadable: symlink loop (the link points back to itself); restore "
        "the file (re-download or re-extract it from the dataset's release) or drop the sample from the dataset"
    ]


def test_a_png_dataset_given_to_the_msd_layout_is_one_line(tmp_path, capsys):
    from PIL import Image

    root = tmp_path / "d"
    for folder in ("imagesTr", "labelsTr"):
        (root / folder).mkdir(parents=True)
    for i in range(8):
        Image.fromarray(np.zeros((24, 24), np.uint8)).save(root / "imagesTr" / f"case_{i:03d}_0000.png")
        Image.fromarray(np.zeros((24, 24), np.uint8)).save(root / "labelsTr" / f"case_{i:03d}.png")
    meta = {"channel_names": {"0": "CT"}, "labels": {"background": 0, "liver": 1, "spleen": 2}, "file_ending": ".png"}
    (root / "dataset.json").write_text(json.dumps(meta))
    code, errors, _ = check(tmp_path, capsys, protocol([32, 32, 32]), root)
    assert code == 2
    (line,) = errors  # one line, not one "unreadable NIfTI" per file
    assert line.startswith(
        f"error: dataset d: {root}: the msd layout reads NIfTI volumes (.nii.gz, .nii), but this dataset's files are "
        ".png (e.g. case_000_0000.png); convert them to NIfTI, or give a 2D dataset a 2D layout (bdd100k, "
        "cholecseg8k, cityscapes, "
    )
