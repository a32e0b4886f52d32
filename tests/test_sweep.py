"""The sweep grids, the K-shot protocol variant and the sweep table files."""

import csv
import json

from jascl.experiments.sweep import GRIDS, with_shots, write_sweep
from jascl.protocols import get_protocol


def test_grids_are_the_papers_values():
    assert [p["gas.eps"] for p in GRIDS["eps"]] == [1e-6, 1e-7, 1e-8, 1e-9]
    assert [p["gas.sigma2"] for p in GRIDS["sigma2"]] == [0.1, 1.0, 10.0]
    assert [p["shots"] for p in GRIDS["shots"]] == [3, 4, 5]
    assert len(GRIDS["tau"]) == 9 and {p["pas.tau_sim"] for p in GRIDS["tau"]} == {0.6, 0.7, 0.8}
    assert all(p["freeze_incremental"] == "none" for p in GRIDS["gas-layer"])


def test_with_shots_changes_only_incremental_sessions():
    p = with_shots(get_protocol("synthetic-2d"), 3)
    assert [s.shots for s in p.sessions] == [None, 3, 3, 3] and p.sessions[0].train == 160
    assert p.sessions[1].num_labelled == 6 and p.name == "synthetic-2d-k3"


def test_sweep_files_quote_point_names(tmp_path):
    rows = [
        {
            "grid": "tau",
            "point": "tau_conf=0.6,tau_sim=0.7",
            "last_all": 0.35,
            "last_base": 0.4,
            "total_drop": 58.0,
            "retention_pct": 38.9,
            "precision": float("nan"),
        }
    ]
    write_sweep(rows, tmp_path, get_protocol("synthetic-2d-ss"), "jascl")
    table = list(csv.reader((tmp_path / "sweep.csv").open()))
    assert table[1] == ["tau", "tau_conf=0.6,tau_sim=0.7", "0.350", "0.400", "58.0", "38.9", "—"]
    assert "| tau | tau_conf=0.6,tau_sim=0.7 | 0.350 |" in (tmp_path / "sweep.md").read_text()
    assert json.loads((tmp_path / "sweep.json").read_text())["rows"][0]["precision"] is None
