"""``jascl report`` (HTML + Markdown), its figures, and the TensorBoard plugin, on a tiny toy run."""

from __future__ import annotations

import json
import math
import shutil
from html.parser import HTMLParser

import numpy as np
import pytest
import torch

from conftest import toy_protocol_dict
from jascl.cli import main
from jascl.engine.config import resolve_config
from jascl.experiments.runner import run_benchmark
from jascl.methods.gas import GASNoise
from jascl.protocols import parse_protocol
from jascl.results import plots
from jascl.results.fidelity import mark
from jascl.results.html import SECTIONS, SectionError, write_report
from jascl.results.report import MISSING
from jascl.results.runs import TOTAL_DROP_ROW, fmt_values, open_run, protocol_from_resolved
from jascl.results.sections import _class_matrix, pseudo_label_section
from jascl.results.tensorboard import gas_scale_stats

METHODS = ["vanilla", "jascl"]
SPLIT_COLUMNS = {
    "All": "all",
    "Old": "old",
    "New": "new",
    "HM": "hm",
    "Base classes": "base",
    "Background": "background",
}


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory):
    """A two-session toy run (vanilla, jascl) with TensorBoard on, and its report (2 overlay samples)."""
    root = tmp_path_factory.mktemp("report")
    protocol = parse_protocol(toy_protocol_dict(2), source="toy-2d.yaml")
    config = resolve_config(protocol.training, "toy-2d.yaml", overrides=["tensorboard=true"])
    run = root / "run"
    results = run_benchmark(
        protocol, config, METHODS, run, cache_dir=root / "cache", progress=False, echo=lambda *a: None
    )
    paths = write_report([run], root / "report", samples=2, cache_dir=root / "cache", echo=lambda *a: None)
    return {
        "root": root,
        "run": run,
        "results": json.loads((run / "results.json").read_text()),
        "html": paths["html"].read_text(),
        "md": paths["markdown"].read_text(),
        "out": root / "report",
        "protocol": protocol,
        "config": config,
        "raw": results,
    }


class _Tables(HTMLParser):
    """Collects ``<table data-table=...>`` cells and ``<section id=...>`` ids from the report."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: dict[str, list[list[str]]] = {}
        self.sections: list[str] = []
        self._table: list[list[str]] | None = None
        self._cell: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "section":
            self.sections.append(attrs.get("id", ""))
        elif tag == "table":
            self._table = self.tables.setdefault(attrs["data-table"], [])
        elif tag == "tr" and self._table is not None:
            self._table.append([])
        elif tag in ("td", "th") and self._table is not None:
            self._cell = []

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self._table[-1].append("".join(self._cell).strip())
            self._cell = None
        elif tag == "table":
            self._table = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)


def _html_tables(page: str) -> _Tables:
    parser = _Tables()
    parser.feed(page)
    return parser


def _md_tables(md: str) -> list[list[list[str]]]:
    """Every Markdown table as a list of rows (header first, separator dropped)."""
    tables, current = [], None
    for line in md.splitlines():
        if line.startswith("| "):
            cells = [c.strip().removeprefix("**").removesuffix("**") for c in line.strip()[1:-1].split(" | ")]
            if all(set(c) <= {"-"} for c in cells):
                continue
            if current is None:
                current = []
                tables.append(current)
            current.append(cells)
        else:
            current = None
    return tables


def _check_cell(cell: str, value, tolerance: float) -> None:
    """A table cell shows ``value`` (3 decimals: within 0.0005) or ``—`` exactly when it is missing."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        assert cell == MISSING
    else:
        assert abs(float(cell) - float(value)) <= tolerance + 1e-9, (cell, value)


def _check_summary(rows: list[list[str]], results: dict) -> None:
    header, body = rows[0], rows[1:]
    # each method with its fidelity mark
    assert header[-3:] == ["Base@last", "HM@last", TOTAL_DROP_ROW] and [r[0] for r in body] == [
        mark(m) for m in METHODS
    ]
    for row in body:
        m = results["methods"][row[0].rsplit(" [", 1)[0]]
        assert len(row) == 4 + len(m["sessions"])
        for cell, record in zip(row[1:-3], m["sessions"]):
            _check_cell(cell, record["all"], 0.0005)
        _check_cell(row[-3], m["sessions"][-1]["base"], 0.0005)
        _check_cell(row[-2], m["sessions"][-1]["hm"], 0.0005)
        _check_cell(row[-1], m["total_drop"], 0.05)


def _check_sessions(rows: list[list[str]], method: dict) -> None:
    header, body = rows[0], rows[1:]
    assert body[-1][0] == TOTAL_DROP_ROW
    _check_cell(body[-1][header.index("All")], method["total_drop"], 0.05)
    assert len(body) - 1 == len(method["sessions"])
    for row, record in zip(body[:-1], method["sessions"]):
        assert int(row[0]) == record["session"] and row[1] == record["name"]
        for column, key in SPLIT_COLUMNS.items():
            _check_cell(row[header.index(column)], record[key], 0.0005)
        # IoU beside Dice: the mean over the seen foreground classes, as "All" (x 100, one decimal)
        iou = [v for c, v in record["iou"].items() if c != "0" and v is not None and not math.isnan(v)]
        _check_cell(row[header.index("All (IoU ×100)")], 100 * sum(iou) / len(iou), 0.05)
        assert float(row[header.index("Train time (s)")].split()[0]) >= 0


def _check_per_class(rows: list[list[str]], method: dict) -> None:
    header, body = rows[0], rows[1:]
    assert header[-3:] == ["Forgetting", "Test pixels/voxels", "Test samples"]
    last = method["sessions"][-1]
    assert [r[0].split()[0] for r in body] == sorted(last["per_class"], key=int)
    for row in body:
        key = row[0].split()[0]
        for t, record in enumerate(method["sessions"]):
            _check_cell(row[1 + t], record["per_class"].get(key), 0.0005)
        earlier = any(r["per_class"].get(key) is not None for r in method["sessions"][:-1])
        _check_cell(row[-3], method["forgetting"].get(key) if earlier else None, 0.0005)  # — for a class new at last
        assert int(row[-2]) == last["support"][key] and int(row[-1]) == last["samples"][key]


def test_report_has_every_section_and_is_self_contained(toy_run):
    page, md, out = toy_run["html"], toy_run["md"], toy_run["out"]
    assert _html_tables(page).sections == [f"p0-{sid}" for sid in SECTIONS if sid != "reproduce"]
    headings = [line[3:] for line in md.splitlines() if line.startswith("## ")]
    # every section but the reproduce table, which only a jascl reproduce folder has
    assert headings == [title for sid, title in SECTIONS.items() if sid != "reproduce"]
    # figures: curves, one heat map per method, losses, one overlay per session; all embedded, none fetched
    assert page.count('src="data:image/png;base64,') == 1 + 2 + 1 + 2
    assert "http://" not in page and "https://" not in page and "<link" not in page and "<script" not in page
    linked = [line.split("](")[1].rstrip(")") for line in md.splitlines() if line.startswith("![")]
    assert sorted(linked) == sorted(
        [
            "p0-curves.png",
            "p0-heatmap-vanilla.png",
            "p0-heatmap-jascl.png",
            "p0-losses.png",
            "p0-qualitative-s0.png",
            "p0-qualitative-s1.png",
        ]
    )
    for name in linked:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # config, versions and manifest: the run's own values
    assert "tensorboard: true" in md and "epochs_incremental: 2" in md
    env = json.loads((toy_run["run"] / "environment.json").read_text())
    assert {"jascl", "torch", "monai", "cuda", "device_count"} <= set(env)
    tables = _html_tables(page).tables
    versions = dict(tables["versions"][1:])
    assert versions["torch"] == torch.__version__ and versions["device_count"] == str(env["device_count"])
    assert versions["effective batch size (labelled; no gradient accumulation)"] == "4"
    assert versions["training seed"] == "3"
    manifest = json.loads((toy_run["run"] / "manifest.json").read_text())
    rows = tables["manifest:3"][1:]
    assert [(int(r[0]), int(r[3]), int(r[4])) for r in rows] == [
        (s["session"], len(s["train"]), len(s["test"])) for s in manifest["sessions"]
    ]
    assert "No pseudo-label statistics" in page  # the toy protocol has no unlabelled pools


def test_html_tables_equal_results_json(toy_run):
    results, tables = toy_run["results"], _html_tables(toy_run["html"]).tables
    _check_summary(tables["summary"], results)
    for name in METHODS:
        _check_sessions(tables[f"sessions:{name}"], results["methods"][name])
        _check_per_class(tables[f"per-class:{name}"], results["methods"][name])
    # the best of each summary column is marked (two methods: the higher score, the lower Total Drop)
    rows = tables["summary"][1:]
    page = toy_run["html"]
    for column in range(1, len(rows[0])):
        values = [float(r[column]) for r in rows]
        if values[0] != values[1]:
            best = rows[values.index(min(values) if column == len(rows[0]) - 1 else max(values))][column]
            assert f"<td><strong>{best}</strong></td>" in page
    assert "1 seed: no uncertainty estimate" in page
    # session 0's time is that of the base each method started from: vanilla's shared one, JASCL's own keyed one
    run = toy_run["run"]
    for name, base in (("vanilla", "base"), ("jascl", "base-stochastic-classifier")):
        rows = tables[f"sessions:{name}"]
        seconds = json.loads((run / base / "metrics.json").read_text())["seconds"]
        assert rows[1][rows[0].index("Train time (s)")] == f"{seconds:.0f} (shared base)"
    # the methods as run, from the registry and config.yaml
    methods = {r[0]: r for r in tables["methods"][1:]}  # each with its fidelity mark, and its label
    assert set(methods) == {mark(m) for m in METHODS} and "gas.eps=1e-08" in methods["jascl [F]"][4]
    assert methods["vanilla [F]"][3] == "faithful" and methods["vanilla [F]"][4] == "none"


def test_markdown_tables_equal_results_json(toy_run):
    results = toy_run["results"]
    md_tables = _md_tables(toy_run["md"])
    _check_summary(md_tables[0], results)
    for name, rows in zip(METHODS, md_tables[1:3]):
        _check_sessions(rows, results["methods"][name])


def test_heatmap_matrix_is_per_class_scores(toy_run):
    run = open_run(toy_run["run"])
    matrix, labels = _class_matrix(run, "jascl")
    assert labels == ["1 disc", "2 square", "3 cross"]
    sessions = toy_run["results"]["methods"]["jascl"]["sessions"]
    assert math.isnan(matrix[2, 0])  # cross is introduced in session 1
    for i, key in enumerate(["1", "2"]):
        assert matrix[i, 0] == pytest.approx(sessions[0]["per_class"][key])
    for i, key in enumerate(["1", "2", "3"]):
        assert matrix[i, 1] == pytest.approx(sessions[1]["per_class"][key])


def test_tensorboard_scalars_match_results(toy_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    results = toy_run["results"]
    for name in METHODS:
        acc = EventAccumulator(str(toy_run["run"] / "tensorboard" / name))
        acc.Reload()
        tags = acc.Tags()["scalars"]
        sessions = results["methods"][name]["sessions"]
        assert [e.step for e in acc.Scalars("eval/all")] == [0, 1]  # session 0 from the shared base's metrics.json
        assert [e.value for e in acc.Scalars("eval/all")] == pytest.approx([s["all"] for s in sessions], abs=1e-6)
        assert acc.Scalars("eval_class/3-cross")[0].value == pytest.approx(sessions[1]["per_class"]["3"], abs=1e-6)
        # incremental session: 4 labelled samples, batch 4 -> 1 iteration per epoch, 2 epochs
        total = acc.Scalars("s1-inc/loss/total")
        assert [e.step for e in total] == [0, 1]
        assert [e.value for e in acc.Scalars("s1-inc/epoch_loss")] == pytest.approx([e.value for e in total])
        gas = [t for t in tags if "/gas/" in t]
        if name == "vanilla":
            assert gas == []
        else:
            assert "s1-inc/loss/proto" in tags and "s1-inc/gas/classifier/scale_mean" in tags
            for step in (0, 1):
                lo, mean, hi = (
                    acc.Scalars(f"s1-inc/gas/classifier/scale_{s}")[step].value for s in ("min", "mean", "max")
                )
                assert 0.0 < lo <= mean <= hi == pytest.approx(1.0)  # the smallest gradient gets scale 1 (eq. 1)


def test_gas_scale_stats_by_hand():
    noise = GASNoise(torch.Size([2]), eps=1.0)
    noise.set_sq_grad(torch.tensor([0.0, 1.0]))
    # G^-1 = [1, 0.5]; scale = (1 + G^-1 - 0.5) / (1 + 1 - 0.5) = [1, 2/3]
    stats = gas_scale_stats(noise)
    assert stats["min"] == pytest.approx(2 / 3) and stats["max"] == pytest.approx(1.0)
    assert stats["mean"] == pytest.approx(5 / 6) and stats["std"] == pytest.approx(1 / 6)


def test_fmt_values_mean_and_sample_std():
    assert fmt_values([0.5], "dice") == "0.500"
    assert fmt_values([0.5, 0.7], "dice") == "0.600 ± 0.141"  # sample std: 0.1 * sqrt(2)
    assert fmt_values([0.5, 0.7], "iou") == "60.0 ± 14.1"
    assert fmt_values([0.5, math.nan], "dice") == "0.500"
    assert fmt_values([math.nan], "dice") == MISSING and fmt_values([], "pct") == MISSING
    assert fmt_values([40.0, 50.0], "pct") == "45.0 ± 7.1"


def test_multi_seed_folder_reports_mean_and_std(toy_run, tmp_path):
    multi = tmp_path / "multi"
    for seed, shift in ((3, 0.0), (4, 0.1)):
        folder = multi / f"seed-{seed}"
        shutil.copytree(toy_run["run"], folder, ignore=shutil.ignore_patterns("*.safetensors", "tensorboard"))
        results = json.loads((folder / "results.json").read_text())
        results["seed"] = seed
        results["methods"]["jascl"]["sessions"][1]["all"] += shift
        results["methods"]["jascl"]["total_drop"] += 100 * shift
        (folder / "results.json").write_text(json.dumps(results))
    (multi / "compare.json").write_text(json.dumps({"seeds": [4, 3]}))
    run = open_run(multi)
    assert run.multi_seed and run.seeds == [4, 3]
    paths = write_report([multi], tmp_path / "out", samples=0, echo=lambda *a: None)
    tables = _html_tables(paths["html"].read_text()).tables
    base = toy_run["results"]["methods"]["jascl"]
    row = {r[0]: r for r in tables["summary"][1:]}["jascl [F]"]
    mean, std = row[2].split(" ± ")
    assert float(mean) == pytest.approx(base["sessions"][1]["all"] + 0.05, abs=5e-4)
    assert float(std) == pytest.approx(0.1 / math.sqrt(2), abs=5e-4)
    drop_mean, drop_std = row[-1].split(" ± ")
    assert float(drop_mean) == pytest.approx(base["total_drop"] + 5.0, abs=0.05)
    assert float(drop_std) == pytest.approx(10 / math.sqrt(2), abs=0.05)
    assert row[1] == f"{base['sessions'][0]['all']:.3f} ± 0.000"  # identical seeds: zero spread
    assert "mean ± std over 2 seeds (4, 3)" in paths["html"].read_text()
    assert set(tables) >= {"manifest:3", "manifest:4"}


def test_pseudo_label_table_and_plot(toy_run, tmp_path):
    folder = tmp_path / "ss"
    shutil.copytree(toy_run["run"], folder, ignore=shutil.ignore_patterns("*.safetensors", "tensorboard"))
    results = json.loads((folder / "results.json").read_text())
    results["methods"]["jascl"]["sessions"][1]["pseudo_labels"] = {
        "filter": "pas",
        "phases": 2,
        "coverage": 0.25,
        "precision": 0.875,
        "confidence_only_coverage": 0.5,
        "confidence_only_precision": 0.75,
        "teacher_error_final": 0.125,
    }
    (folder / "results.json").write_text(json.dumps(results))
    blocks = pseudo_label_section(open_run(folder), "p0")
    table = next(b for b in blocks if b.kind == "table")
    assert table.name == "pseudo-labels:jascl"  # vanilla has no statistics: no table
    assert table.rows == [["1", "inc", "pas", "2", "0.250", "0.875", "0.500", "0.750", "0.125"]]
    assert [b.kind for b in blocks] == ["table", "figure"] and blocks[1].png[:4] == b"\x89PNG"


def test_a_section_that_cannot_be_built_is_an_error_unless_skipped(toy_run, tmp_path):
    folder = tmp_path / "broken"
    shutil.copytree(toy_run["run"], folder, ignore=shutil.ignore_patterns("tensorboard"))
    (folder / "protocol-resolved.json").unlink()
    with pytest.raises(SectionError) as info:
        write_report([folder], tmp_path / "out", samples=1, echo=lambda *a: None)
    assert str(info.value) == (
        f"report: qualitative: {folder}: neither protocol-resolved.json nor protocol.yaml; "
        "--skip qualitative leaves the section out"
    )
    assert not (tmp_path / "out").exists()  # nothing written
    paths = write_report([folder], tmp_path / "out", samples=1, echo=lambda *a: None, skip=["qualitative", "config"])
    page = paths["html"].read_text()
    section = page.split('<section id="p0-qualitative">')[1].split("</section>")[0]
    assert "Left out (--skip qualitative)." in section and "data:image/png" not in section
    assert _html_tables(page).sections == [f"p0-{sid}" for sid in SECTIONS if sid != "reproduce"]


def test_loss_curves_have_one_point_per_trained_epoch(toy_run):
    from jascl.results.losses import TOTAL, loss_series, parse_log

    run = open_run(toy_run["run"])
    parsed = [parse_log((toy_run["run"] / "log.txt").read_text().splitlines())]
    config = toy_run["config"]
    # session 0 from the lines of the shared base model each method starts from (jascl's is keyed)
    for method, base in zip(METHODS, ["base", "base-stochastic-classifier"]):
        assert (toy_run["run"] / base / "metrics.json").is_file()
        sessions = loss_series(run, method, parsed)
        assert [label for label, _ in sessions] == [f"S0 base · shared model {base}", "S1 inc"]
        assert [len(series[TOTAL]) for _, series in sessions] == [config.epochs_base, config.epochs_incremental]
    assert "read from " + str(toy_run["run"] / "log.txt") in toy_run["html"]


def test_protocol_round_trips_through_resolved_json(toy_protocol):
    import dataclasses

    from jascl.data.synthetic import protocol_digest

    data = json.loads(json.dumps(dataclasses.asdict(toy_protocol), default=list))
    rebuilt = protocol_from_resolved(data)
    assert rebuilt == toy_protocol
    assert protocol_digest(rebuilt) == protocol_digest(toy_protocol)  # same synthetic data cache


def test_display_slice_picks_the_slice_with_most_foreground():
    volume = np.arange(4 * 4 * 6, dtype=float).reshape(4, 4, 6)
    label = np.zeros((4, 4, 6), dtype=np.uint8)
    label[0, 0, 1] = 1
    label[:2, :2, 4] = 2
    view, where = plots.display_slice(volume, label)
    assert where == "slice 4/6 along array axis 2" and np.array_equal(view, volume[..., 4])
    # no foreground: the middle slice
    assert plots.display_slice(volume, np.zeros_like(label))[1] == "slice 3/6 along array axis 2"
    image = np.ones((5, 5))
    assert plots.display_slice(image)[0] is image


def test_cli_report_and_one_line_error(toy_run, tmp_path, capsys):
    out = tmp_path / "cli"
    assert main(["report", str(toy_run["run"]), "--out", str(out), "--samples", "0"]) == 0
    assert (out / "report.html").is_file() and (out / "report.md").is_file()
    assert "Skipped (--samples 0)" in (out / "report.md").read_text()
    assert main(["report", str(tmp_path / "nothing"), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "nothing: no results.json" in err


def test_tensorboard_toggle_does_not_block_resuming(toy_run, tmp_path):
    folder = tmp_path / "resume"
    shutil.copytree(toy_run["run"], folder, ignore=shutil.ignore_patterns("tensorboard"))
    config = resolve_config(toy_run["protocol"].training, "toy-2d.yaml")  # tensorboard off now
    again = run_benchmark(
        toy_run["protocol"],
        config,
        METHODS,
        folder,
        progress=False,
        echo=lambda *a: None,
        cache_dir=toy_run["root"] / "cache",
    )
    assert (
        again["methods"]["jascl"]["sessions"][1]["all"] == toy_run["results"]["methods"]["jascl"]["sessions"][1]["all"]
    )
    assert not (folder / "tensorboard").exists()


def test_an_oracle_record_gets_a_table_of_the_pixels_it_revealed(toy_run, tmp_path):
    """HALO's oracle: the report states how many pool pixels it revealed, against its budget."""
    folder = tmp_path / "oracle"
    shutil.copytree(toy_run["run"], folder, ignore=shutil.ignore_patterns("*.safetensors", "tensorboard"))
    results = json.loads((folder / "results.json").read_text())
    results["methods"]["jascl"]["sessions"][1]["pseudo_labels"] = {
        "method": "halo",
        "filter": "oracle",
        "rounds": 5,
        "coverage": 0.05,
        "precision": 1.0,
        "revealed": 205,
        "budget_pixels": 225,
        "without_truth": 0,
    }
    (folder / "results.json").write_text(json.dumps(results))
    blocks = pseudo_label_section(open_run(folder), "p0")
    oracle = next(b for b in blocks if b.kind == "table" and b.name == "oracle:jascl")
    assert oracle.rows == [["1", "inc", "205", "225", "0"]]
