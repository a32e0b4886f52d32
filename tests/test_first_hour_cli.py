"""The smaller defects of issue 35 a new user met in the first hour: "did you mean", the resume message, the ``all``
extra, seeds, ``--split-manifest`` beyond ``run`` (and the held-out cases ``data check`` lists), ``jascl methods
NAME`` at 80 columns, report figures' permissions, overlay slices inside the foreground."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fixtures import medical as fxm  # noqa: E402
from jascl.cli import main  # noqa: E402
from jascl.registry import did_you_mean  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


# --- did you mean ---------------------------------------------------------------------------------------------


def test_did_you_mean():
    assert did_you_mean("jascI", ["jascl", "vanilla"]) == " (did you mean 'jascl'?)"
    assert did_you_mean("Vanila", ["jascl", "vanilla"]) == " (did you mean 'vanilla'?)"  # case ignored
    assert did_you_mean("synthetic2d", ["synthetic-2d", "synthetic-3d", "natural"]) == (
        " (did you mean 'synthetic-2d' or 'synthetic-3d'?)"
    )
    assert did_you_mean("zzz", ["jascl", "vanilla"]) == ""


def test_a_misspelt_method_protocol_or_backbone_gets_a_suggestion_and_imports_nothing_heavy():
    """In a fresh interpreter: the method is refused from the registry index (no method module, no torch)."""
    code = textwrap.dedent(
        """
        import contextlib, io, json, sys
        from jascl.cli import main
        out = {}
        for args in (["run", "--methods", "vanilla,jascI"], ["run", "--protocol", "synthetic2d"],
                     ["compare", "--methods", "vanila+jascl"]):
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                out[args[-1]] = [main(args), err.getvalue()]
        out["heavy"] = [m for m in ("torch", "monai", "jascl.methods.presets") if m in sys.modules]
        print(json.dumps(out))
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    found = json.loads(done.stdout.splitlines()[-1])
    assert found["vanilla,jascI"][0] == 2
    assert found["vanilla,jascI"][1].startswith("jascl: error: unknown method 'jascI' (did you mean 'jascl'?);")
    assert found["synthetic2d"][1].startswith(
        "jascl: error: protocol 'synthetic2d' (did you mean 'synthetic-2d' or 'synthetic-3d'?): not a built-in"
    )
    assert "unknown method 'vanila' (did you mean 'vanilla'?) in 'vanila+jascl'" in found["vanila+jascl"][1]
    assert found["heavy"] == []


def test_a_misspelt_backbone_is_refused_before_the_run_starts(tmp_path, capsys):
    from conftest import toy_protocol_dict

    path = tmp_path / "toy.yaml"
    path.write_text(yaml.safe_dump(toy_protocol_dict(2)))
    out = tmp_path / "run"
    code = main(["run", "--protocol", str(path), "--backbone", "unnet", "--out", str(out), "--no-progress"])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == "" and not out.exists()  # no header, no folder: nothing started
    assert captured.err.startswith("jascl: error: unknown backbone 'unnet' (did you mean 'unet'?); choose one of:")


# --- resume message, extras, seeds ----------------------------------------------------------------------------


def test_the_resume_error_names_no_version(tmp_path, capsys):
    assert main(["run", "--resume", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"jascl: error: {tmp_path}: not a jascl run folder (no run.json)")
    assert "jascl 0." not in err


def test_an_all_extra_installs_every_optional_dependency():
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    users = set(extras["natural"]) | set(extras["clip"]) | set(extras["diffusion"])  # test and dev are the project's
    assert set(extras["all"]) == users


def test_seeds_and_num_seeds_on_the_command_line(tmp_path, capsys, monkeypatch):
    """--seeds 1024 is the seed 1024 (it was refused as "1024 seeds"); --num-seeds counts."""
    import jascl.experiments.compare as compare

    seen = []
    monkeypatch.setattr(compare, "run_compare", lambda p, c, m, seeds, out, **kw: seen.append(seeds) or {"methods": {}})
    monkeypatch.setattr("jascl.experiments.compare.compare_table", lambda summary: ([], []))
    monkeypatch.setattr("jascl.experiments.compare.compare_title", lambda summary: "")
    common = ["--methods", "vanilla", "--out", str(tmp_path / "c"), "--no-progress"]
    assert main(["compare", "--seeds", "1024", *common]) == 0
    assert main(["compare", "--num-seeds", "3", *common]) == 0
    assert main(["compare", *common]) == 0  # the protocol's seed
    assert main(["run", "--seeds", "7,8", *common]) == 0
    assert seen == [[1024], [1024, 1025, 1026], [1024], [7, 8]]
    assert main(["run", "--seeds", "7", "--num-seeds", "2", *common]) == 2
    assert "give the seed values (--seeds 1024,7) or a count" in capsys.readouterr().err


# --- --split-manifest on data check, compare, sweep and reproduce ---------------------------------------------


def msd_protocol(tmp_path: Path) -> Path:
    spec = {
        "name": "fixed-split",
        "seed": 1,
        "spatial_dims": 3,
        "in_channels": 1,
        "metric": "dice",
        "classes": [{"id": 0, "name": "background"}, {"id": 1, "name": "liver"}, {"id": 2, "name": "spleen"}],
        "domains": {"ct": {}},
        "datasets": {"d": {"layout": "msd", "domain": "ct", "labels": {1: "liver", 2: "spleen"}, "test_fraction": 0.4}},
        "sessions": [
            {"name": "base", "domains": ["ct"], "new_classes": [1], "shots": "all", "sources": ["d"]},
            {"name": "spleen", "domains": ["ct"], "new_classes": [2], "shots": 1, "sources": ["d"]},
        ],
        "training": {
            "patch_size": [32, 32, 32],
            "backbone_args": {"features": [4, 4, 4, 4, 4, 4]},
            "epochs_base": 1,
            "epochs_incremental": 1,
            "batch_size": 2,
            "threads": 1,
        },
    }
    path = tmp_path / "fixed.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def manifest_of(tmp_path: Path, protocol_path: Path, root: Path, seed: int) -> tuple[Path, dict]:
    import dataclasses

    from jascl.data.real import load_real
    from jascl.protocols import get_protocol

    protocol = dataclasses.replace(get_protocol(str(protocol_path)), seed=seed)
    _, manifest = load_real(protocol, {"d": root}, tmp_path / "cache", echo=lambda m: None)
    path = tmp_path / f"manifest-{seed}.json"
    path.write_text(json.dumps(manifest))
    return path, manifest


def test_data_check_checks_a_split_manifest_and_lists_the_held_out_cases(tmp_path, capsys):
    root = fxm.write_msd(tmp_path / "d", cases=10, shape=(32, 32, 32), test_cases=0)
    protocol = msd_protocol(tmp_path)
    path, manifest = manifest_of(tmp_path, protocol, root, seed=1)
    held = sorted({ref.split("/", 1)[1] for s in manifest["sessions"] for ref in s["test"]})
    args = ["data", "check", "--protocol", str(protocol), "--root", f"d={root}", "--cache-dir", str(tmp_path / "c")]
    assert main([*args, "--seed", "5", "--split-manifest", str(path)]) == 0  # another seed, the manifest's split
    out = capsys.readouterr().out.splitlines()
    assert out[out.index("held out for testing (never trained on):") + 1] == f"  d ({len(held)}): {', '.join(held)}"
    other = dict(manifest, protocol="another")
    (tmp_path / "other.json").write_text(json.dumps(other))
    assert main([*args, "--split-manifest", str(tmp_path / "other.json")]) == 2
    errors = [line for line in capsys.readouterr().out.splitlines() if line.startswith("error: ")]
    assert errors == [
        f"error: --split-manifest {tmp_path / 'other.json'}: {tmp_path / 'other.json'}: made for protocol 'another', "
        "not 'fixed-split'; use a manifest written by a run of this protocol"
    ]


def test_compare_over_seeds_on_a_fixed_split(tmp_path, capsys):
    """Two seeds, one split: every seed's run folder records the given manifest's samples."""
    root = fxm.write_msd(tmp_path / "d", cases=6, shape=(32, 32, 32), test_cases=0)
    protocol = msd_protocol(tmp_path)
    path, manifest = manifest_of(tmp_path, protocol, root, seed=1)
    out = tmp_path / "cmp"
    threads = torch.get_num_threads()
    try:
        code = main(
            ["compare", "--protocol", str(protocol), "--root", f"d={root}", "--methods", "vanilla", "--seeds", "3,4"]
            + ["--split-manifest", str(path), "--out", str(out), "--cache-dir", str(tmp_path / "c"), "--no-progress"]
        )
    finally:
        torch.set_num_threads(threads)
    assert code == 0, capsys.readouterr().err
    for seed in (3, 4):
        ran = json.loads((out / f"seed-{seed}" / "manifest.json").read_text())
        assert ran["seed"] == seed
        assert [(s["train"], s["test"]) for s in ran["sessions"]] == [
            (s["train"], s["test"]) for s in manifest["sessions"]
        ]


def test_sweep_and_reproduce_take_a_split_manifest(tmp_path, monkeypatch, capsys):
    import jascl.experiments.sweep as sweep
    from jascl.experiments.reproduce import manifest_for

    given = {}
    monkeypatch.setattr(sweep, "run_sweep", lambda *a, **kw: given.update(kw) or [])
    monkeypatch.setattr(sweep, "sweep_table", lambda rows: ([], []))
    assert main(["sweep", "--split-manifest", "m.json", "--root", "d=/data/d", "--out", str(tmp_path / "s")]) == 0
    assert given["split_manifest"] == "m.json" and given["roots"] == {"d": "/data/d"}
    one = tmp_path / "a.json"
    one.write_text(json.dumps({"protocol": "med-ss", "sessions": []}))
    assert manifest_for("med-ss", [str(one)]) == str(one) and manifest_for("med-disjoint", [str(one)]) is None
    capsys.readouterr()
    assert main(["reproduce", "tab_set1_part", "--split-manifest", str(one), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert f"--split-manifest {one}: written by a run of none of this table's protocols" in err


# --- jascl methods NAME at 80 columns -------------------------------------------------------------------------


def test_methods_name_is_readable_at_80_columns(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["methods", "jascl"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert max(len(line.rstrip()) for line in lines) <= 80
    from jascl.methods.registry import describe_method

    for row in describe_method("jascl")["options"]:  # a heading line per option, its description below
        heading = [line for line in lines if line.startswith(f"{row['name']}  (")]
        assert len(heading) == 1 and f"default {row['default']}" in heading[0]
    assert not any("│" in line for line in lines)  # no table of five wrapped columns
    monkeypatch.setenv("COLUMNS", "160")
    assert main(["methods", "jascl"]) == 0
    assert "┃ option" in capsys.readouterr().out  # wide terminals keep the table


# --- report figures and overlays ------------------------------------------------------------------------------


def test_binary_files_are_readable_as_the_umask_allows(tmp_path):
    from jascl.fileio import atomic_write_bytes

    umask = os.umask(0o022)
    try:
        atomic_write_bytes(tmp_path / "figure.png", b"\x89PNG")
    finally:
        os.umask(umask)
    assert (tmp_path / "figure.png").stat().st_mode & 0o777 == 0o644  # was mkstemp's 0600


def test_overlay_slices_spread_inside_the_foreground_not_at_its_edge():
    """Foreground on z = 10..30, a one-voxel tail at each end and a block in the middle; --slices 2 used to show
    z = 30 (one voxel). The extent's two halves are centred on floor(10 + 21/4) = 15 and floor(10 + 63/4) = 25;
    15 is nearest the fullest (20) and gives way to it."""
    from jascl.results import plots

    label = np.zeros((8, 8, 40), np.uint8)
    label[0, 0, 10] = label[0, 0, 30] = 1
    label[2:6, 2:6, 16:25] = 1
    label[:, :, 20] = 1
    assert [v.index for v in plots.choose_slices(label, label.shape, count=2)] == [20, 25]
    assert [v.index for v in plots.choose_slices(label, label.shape, count=3)] == [20, 13, 27]


@pytest.mark.parametrize("command", [["sweep"], ["compare"], ["data", "check"], ["reproduce"], ["run"]])
def test_split_manifest_is_an_option_of(command, capsys):
    assert main([*command, "--help"]) == 0
    assert "--split-manifest" in capsys.readouterr().out
