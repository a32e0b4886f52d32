"""``jascl report`` reads what it needs from the run folder: the protocol as resolved (label maps with their integer
native ids), the dataset roots recorded at run time (``--root`` / ``--roots`` over them), the split sizes of the
manifest; a section that cannot be produced is an error unless ``--skip``ped. On a tiny 3D run in the MSD layout."""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fixtures import medical as fxm  # noqa: E402
from jascl.cli import main  # noqa: E402
from jascl.engine.config import resolve_config  # noqa: E402
from jascl.errors import ConfigError  # noqa: E402
from jascl.experiments.runner import check_reusable  # noqa: E402
from jascl.protocols import get_protocol, parse_protocol  # noqa: E402
from jascl.protocols.resolved import protocol_from_json, protocol_to_json  # noqa: E402
from jascl.results.html import SECTIONS, SectionError, write_report  # noqa: E402
from jascl.results.runs import RootOptions, protocol_from_resolved, run_roots  # noqa: E402

SHAPE = (32, 32, 32)  # the smallest the tiny U-Net takes (a multiple of 16, at least 32)


def msd_protocol() -> dict:
    """Two MSD-layout datasets with integer native ids: 'ct' teaches liver, spleen (base, every sample), 'mr' tumour
    and cyst with K = 1, which one sample showing both satisfies (labelled 1 where the protocol asks for 2)."""
    return {
        "name": "msd-report",
        "seed": 7,
        "spatial_dims": 3,
        "in_channels": 1,
        "metric": "dice",
        "classes": [
            {"id": 0, "name": "background"},
            {"id": 1, "name": "liver"},
            {"id": 2, "name": "spleen"},
            {"id": 3, "name": "tumour"},
            {"id": 4, "name": "cyst"},
        ],
        "domains": {"ct": {}, "mr": {}},
        "datasets": {
            "ct": {
                "layout": "msd",
                "domain": "ct",
                "labels": {1: "liver", 2: "spleen"},
                "preprocess": {"intensity": "ct"},
            },
            "mr": {"layout": "msd", "domain": "mr", "labels": {1: 3, 2: "cyst"}, "preprocess": {"intensity": "ct"}},
        },
        "sessions": [
            {"name": "base", "domains": ["ct"], "new_classes": [1, 2], "shots": "all", "sources": ["ct"]},
            {"name": "lesions", "domains": ["mr"], "new_classes": [3, 4], "shots": 1, "sources": ["mr"]},
        ],
        "training": {
            "backbone": "unet",
            "backbone_args": {"features": [4, 4, 8, 8, 8, 8]},
            "patch_size": list(SHAPE),
            "epochs_base": 1,
            "epochs_incremental": 1,
            "batch_size": 2,
            "augment": False,
            "device": "cpu",
        },
    }


@pytest.fixture(scope="module")
def msd_run(tmp_path_factory):
    """A finished two-session vanilla run on tiny MSD copies (``jascl run --root``), and its protocol file."""
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("msd-report")
    roots = {
        "ct": fxm.write_msd(root / "data" / "ct", cases=4, shape=SHAPE, labels=(1, 2), test_cases=0),
        "mr": fxm.write_msd(root / "data" / "mr", cases=4, shape=SHAPE, labels=(1, 2), test_cases=0, seed=1),
    }
    path = root / "msd-report.yaml"
    path.write_text(yaml.safe_dump(msd_protocol()))
    run = root / "run"
    args = ["run", "--protocol", str(path), "--methods", "vanilla", "--out", str(run), "--no-progress"]
    args += ["--cache-dir", str(root / "cache")] + [f"--root={n}={p}" for n, p in roots.items()]
    assert main(args) == 0
    return {"root": root, "run": run, "roots": roots, "protocol": path}


def _section(page: str, sid: str) -> str:
    return page.split(f'<section id="p0-{sid}">')[1].split("</section>")[0]


def _report(args: list[str], capsys) -> tuple[int, list[str]]:
    code = main(["report", *args])
    return code, capsys.readouterr().err.strip().splitlines()


# --------------------------------------------------------------------------------------------- the protocol round trip


def test_label_maps_keep_integer_ids_through_protocol_resolved_json(msd_run):
    written = json.loads((msd_run["run"] / "protocol-resolved.json").read_text())
    rebuilt = protocol_from_resolved(written)
    protocol = dataclasses.replace(get_protocol(msd_run["protocol"]), seed=7)
    assert rebuilt == protocol  # dataclass equality: label maps, tuples, everything
    assert rebuilt.datasets["ct"].labels == {1: 1, 2: 2} and rebuilt.datasets["mr"].labels == {1: 3, 2: 4}


def test_label_map_types_round_trip_and_older_run_folders_still_read():
    data = msd_protocol()
    data["datasets"]["mr"]["labels"] = {1: "tumour", "class2": "cyst"}  # a native id and a native label name
    protocol = parse_protocol(data, "msd-report.yaml")
    assert protocol_from_json(json.loads(json.dumps(protocol_to_json(protocol)))) == protocol
    # run folders written before: label maps as JSON objects, every native id a string
    legacy = json.loads(json.dumps(dataclasses.asdict(protocol), default=list))
    assert legacy["datasets"]["mr"]["labels"] == {"1": 3, "class2": 4}
    assert protocol_from_resolved(legacy).datasets["mr"].labels == {1: 3, "class2": 4}
    assert protocol_from_resolved(legacy) == protocol


def test_a_run_folder_with_the_older_label_map_format_still_resumes(tmp_path):
    protocol = parse_protocol(msd_protocol(), "msd-report.yaml")
    config = resolve_config(protocol.training, "msd-report.yaml")
    legacy = json.loads(json.dumps(dataclasses.asdict(protocol), default=list))
    (tmp_path / "protocol-resolved.json").write_text(json.dumps(legacy))
    check_reusable(tmp_path, config, protocol)  # the same protocol: no complaint
    other = msd_protocol()
    other["datasets"]["mr"]["labels"] = {1: 4, 2: 3}
    with pytest.raises(ConfigError, match=r"different protocol \(datasets\)"):
        check_reusable(tmp_path, config, parse_protocol(other, "msd-report.yaml"))


# --------------------------------------------------------------------------------------------- the report of a 3D run


def test_report_of_a_3d_msd_run_renders_overlays_and_the_splits_used(msd_run, tmp_path):
    paths = write_report([msd_run["run"]], tmp_path / "report", samples=1, echo=lambda *a: None)
    page = paths["html"].read_text()
    qualitative = _section(page, "qualitative")
    assert qualitative.count("data:image/png;base64,") == 2  # one figure per session
    assert "not available" not in qualitative
    # the protocol table shows the samples the run used (manifest.json), the protocol's value where it differs
    manifest = json.loads((msd_run["run"] / "manifest.json").read_text())
    used = [(len(s["train"]), len(s["test"])) for s in manifest["sessions"]]
    assert used == [(3, 1), (1, 1)]  # 4 cases: 1 held out for testing; one sample shows both lesions
    config = _section(page, "config")
    rows = [r.split("</td>")[:-1] for r in config.split("<tr>")[2:]]
    cells = [[c.rsplit(">", 1)[-1] for c in r] for r in rows]
    assert [(r[6], r[7], r[8]) for r in cells] == [("3", "0", "1"), ("1 (protocol: 2)", "0", "1")]
    assert "None" not in config


def test_a_missing_root_fails_with_one_line_and_keeps_the_previous_report(msd_run, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("JASCL_ROOT_CT", raising=False)
    run = tmp_path / "run"
    shutil.copytree(msd_run["run"], run)
    record = json.loads((run / "run.json").read_text())
    moved = tmp_path / "gone" / "ct"
    record["roots"]["ct"] = record["resolved_roots"]["ct"] = str(moved)  # as if the data moved after the run
    (run / "run.json").write_text(json.dumps(record))
    out = tmp_path / "report"
    out.mkdir()
    (out / "report.html").write_text("the previous report")
    code, err = _report([str(run), "--out", str(out), "--samples", "1"], capsys)
    assert code == 2 and len(err) == 1, err
    line = err[0]
    assert line.startswith("jascl: error: report: qualitative: dataset root 'ct' not found at " + str(moved))
    assert str(run / "run.json") in line and "--root ct=PATH" in line and "--skip qualitative" in line
    assert str(msd_run["protocol"]) not in line  # never the YAML file the run started from
    assert (out / "report.html").read_text() == "the previous report" and not (out / "report.md").exists()
    # --skip qualitative: the rest of the report
    code, err = _report([str(run), "--out", str(out), "--samples", "1", "--skip", "qualitative"], capsys)
    assert code == 0, err
    page = (out / "report.html").read_text()
    assert "Left out (--skip qualitative)." in _section(page, "qualitative") and "data:image/png" in page
    # --root overrides the recorded root: overlays again
    code, err = _report(
        [str(run), "--out", str(out), "--samples", "1", "--root", f"ct={msd_run['roots']['ct']}"], capsys
    )
    assert code == 0, err
    assert _section((out / "report.html").read_text(), "qualitative").count("data:image/png") == 2


def test_roots_precedence_for_reports(msd_run, tmp_path):
    run, real = msd_run["run"], msd_run["roots"]
    protocol = protocol_from_resolved(json.loads((run / "protocol-resolved.json").read_text()))
    elsewhere = tmp_path / "copy-of-ct"
    elsewhere.mkdir()
    # recorded at run time > the environment
    env = {"JASCL_ROOT_CT": str(elsewhere), "JASCL_ROOT_MR": str(elsewhere)}
    assert run_roots(run, protocol, RootOptions(), env) == real
    # --roots FILE > recorded; --root > --roots FILE
    roots_file = tmp_path / "roots.yaml"
    roots_file.write_text(yaml.safe_dump({"ct": str(elsewhere)}))
    assert run_roots(run, protocol, RootOptions(file=str(roots_file)), env)["ct"] == elsewhere
    given = RootOptions({"ct": str(real["ct"])}, str(roots_file))
    assert run_roots(run, protocol, given, env)["ct"] == real["ct"]


def test_report_options_are_checked_before_anything_is_built(msd_run, tmp_path, capsys):
    out = tmp_path / "report"
    code, err = _report([str(msd_run["run"]), "--out", str(out), "--skip", "qualitative,figures"], capsys)
    assert code == 2 and len(err) == 1 and "--skip figures: not a report section" in err[0]
    assert all(sid in err[0] for sid in SECTIONS)
    code, err = _report([str(msd_run["run"]), "--out", str(out), "--root", "mri=/data"], capsys)
    assert code == 2 and len(err) == 1 and "--root mri=...: no input's protocol has a dataset root" in err[0]
    assert "(their roots: ct, mr)" in err[0] and not out.exists()


def test_a_section_error_names_the_section_and_skip_leaves_it_out(msd_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(msd_run["run"], run)
    (run / "manifest.json").unlink()
    with pytest.raises(SectionError, match=r"^report: manifest: .*manifest\.json not found") as info:
        write_report([run], tmp_path / "report", samples=0, echo=lambda *a: None)
    assert info.value.section == "manifest" and "\n" not in str(info.value)
    paths = write_report([run], tmp_path / "report", samples=0, echo=lambda *a: None, skip=["manifest"])
    page = paths["html"].read_text()
    assert "Left out (--skip manifest)." in _section(page, "manifest")
    assert "manifest.json not found; all = every eligible sample" in _section(page, "config")  # the protocol's sizes
