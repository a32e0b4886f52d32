"""``jascl compare``: seeds, aggregation (mean ± sample std), the table and the run folders."""

import json
import math

import pytest

from jascl.cli import main
from jascl.errors import ConfigError
from jascl.experiments.compare import aggregate, compare_table, mean_std, parse_seeds, run_compare


def test_parse_seeds():
    """--seeds takes seed values (one value is one seed), --num-seeds a count from the protocol's seed."""
    assert parse_seeds("1024", 5) == [1024]  # the seed 1024, not 1024 seeds
    assert parse_seeds("3", 1024) == [3]
    assert parse_seeds("1024,7", 5) == [1024, 7]
    assert parse_seeds("1024,", 5) == [1024]  # the old spelling of one seed still reads
    assert parse_seeds(None, 1024, 3) == [1024, 1025, 1026]
    assert parse_seeds(None, 7) == [7]
    assert len(parse_seeds(None, 0, 100)) == 100
    with pytest.raises(ConfigError, match=r"^--seeds 1,2 with --num-seeds 2: give the seed values"):
        parse_seeds("1,2", 1, 2)
    for count in (0, 101):
        with pytest.raises(ConfigError, match=rf"^--num-seeds {count}: give a count from 1 to 100$"):
            parse_seeds(None, 1, count)
    for bad in ("x", "1,1", "-1,2", ","):
        with pytest.raises(ConfigError, match="--seeds"):
            parse_seeds(bad, 1)


def test_mean_std_is_sample_std_and_skips_nan():
    mean, std = mean_std([0.2, 0.4, math.nan])
    assert mean == pytest.approx(0.3)
    assert std == pytest.approx(math.sqrt(0.02))  # ((0.1^2 + 0.1^2) / (2 - 1)) ** 0.5
    assert mean_std([0.5]) == (0.5, 0.0)
    assert all(math.isnan(v) for v in mean_std([]))


def _results(all_scores, drop):
    return {
        "protocol": "p",
        "metric": "dice",
        "methods": {
            "m": {
                "sessions": [
                    {"session": t, "name": f"s{t}", "all": v, "old": v, "new": v, "base": v}
                    for t, v in enumerate(all_scores)
                ],
                "total_drop": drop,
            }
        },
    }


def test_aggregate_and_table_by_hand():
    summary = aggregate({1: _results([0.8, 0.4], 50.0), 2: _results([0.6, 0.2], 66.7)}, ["m"])
    m = summary["methods"]["m"]
    assert m["sessions"][0]["all"] == pytest.approx([0.7, math.sqrt(0.02)])
    assert m["sessions"][1]["values"] == [0.4, 0.2]
    assert m["total_drop"][0] == pytest.approx(58.35)
    header, rows = compare_table(summary)
    assert header == ["Method", "S0 (s0)", "S1 (s1)", "Total Drop (%)"]
    assert rows == [["m [?]", "0.700 ± 0.141", "0.300 ± 0.141", "58.4 ± 11.8"]]  # "m": no registered method


def test_run_compare_two_seeds_shares_base_and_writes_tables(toy_protocol, toy_config, tmp_path):
    summary = run_compare(
        toy_protocol,
        toy_config,
        ["vanilla", "lwf"],
        [3, 4],
        tmp_path / "cmp",
        cache_dir=tmp_path / "cache",
        progress=False,
        echo=lambda *a: None,
    )
    for seed in (3, 4):
        run = json.loads((tmp_path / "cmp" / f"seed-{seed}" / "results.json").read_text())
        assert run["seed"] == seed
        a, b = (run["methods"][m]["sessions"][0]["all"] for m in ("vanilla", "lwf"))
        assert a == b  # one shared base model per seed
    v = summary["methods"]["vanilla"]
    per_seed = [
        json.loads((tmp_path / "cmp" / f"seed-{s}" / "results.json").read_text())["methods"]["vanilla"]["sessions"][1][
            "all"
        ]
        for s in (3, 4)
    ]
    assert v["sessions"][1]["all"][0] == pytest.approx(sum(per_seed) / 2)
    assert per_seed[0] != per_seed[1]  # the seeds really differ
    md = (tmp_path / "cmp" / "compare.md").read_text()
    assert "mean ± std over 2 seeds (3, 4)" in md and "| lwf [F] |" in md and "- [F] lwf: faithful" in md
    csv_lines = (tmp_path / "cmp" / "compare.csv").read_text().splitlines()
    assert csv_lines[0].startswith("method,session,name,all_mean")
    assert len(csv_lines) == 1 + 2 * (2 + 1)
    # rerun: everything reused, identical summary
    again = run_compare(
        toy_protocol,
        toy_config,
        ["vanilla", "lwf"],
        [3, 4],
        tmp_path / "cmp",
        cache_dir=tmp_path / "cache",
        progress=False,
        echo=lambda *a: None,
    )
    assert again["methods"]["vanilla"]["sessions"][1]["values"] == v["sessions"][1]["values"]


def test_compare_cli_rejects_unknown_method_and_bad_seeds(capsys):
    assert main(["compare", "--methods", "vanilla,nope", "--no-progress"]) == 2
    assert "unknown method 'nope'" in capsys.readouterr().err
    assert main(["compare", "--num-seeds", "0", "--no-progress"]) == 2
    assert "--num-seeds 0" in capsys.readouterr().err
    assert main(["compare", "--seeds", "1,1", "--no-progress"]) == 2
    assert "--seeds 1,1: seeds must be distinct" in capsys.readouterr().err


def test_run_with_seeds_writes_per_seed_folders_and_aggregate(tmp_path, capsys):
    import yaml

    from conftest import toy_protocol_dict

    path = tmp_path / "toy.yaml"
    path.write_text(yaml.safe_dump(toy_protocol_dict(2)))
    out = tmp_path / "multi"
    code = main(
        [
            "run",
            "--protocol",
            str(path),
            "--methods",
            "vanilla",
            "--seeds",
            "5,6",
            "--out",
            str(out),
            "--cache-dir",
            str(tmp_path / "cache"),
            "--no-progress",
        ]
    )
    assert code == 0, capsys.readouterr().err
    summary = json.loads((out / "compare.json").read_text())
    assert summary["seeds"] == [5, 6]
    values = [
        json.loads((out / f"seed-{s}" / "results.json").read_text())["methods"]["vanilla"]["total_drop"] for s in (5, 6)
    ]
    assert summary["methods"]["vanilla"]["total_drop"][0] == pytest.approx(sum(values) / 2)
