"""The worked example of docs/own-data-and-backbone.md, run as written: its protocol YAML and its three commands
(``data check``, ``run``, ``report``) are read from the page and run on a small MSD folder of our own. Only the
paths change, and the run gets ``--set`` keys that make it a few seconds long on a CPU."""

import shlex
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fixtures import medical as fxm  # noqa: E402
from jascl.cli import main  # noqa: E402

PAGE = Path(__file__).resolve().parents[1] / "docs" / "own-data-and-backbone.md"
FAST = ["--set", "patch_size=[32,32,32]", "--set", "epochs_base=1", "--set", "epochs_incremental=1"]
FAST += ["--set", "backbone_args={features: [4, 4, 4, 4, 4, 4]}", "--set", "threads=1"]


def block_after(marker: str) -> str:
    """The fenced code block that follows ``<!-- marker -->`` on the page."""
    text = PAGE.read_text()
    start = text.index(f"<!-- {marker} -->")
    opening = text.index("```", start)
    body = text.index("\n", opening) + 1
    return text[body : text.index("```", body)]


@pytest.mark.slow
def test_the_worked_example_runs_as_written(tmp_path, capsys, monkeypatch):
    data = fxm.write_msd(tmp_path / "my-ct", cases=8, shape=(32, 32, 32), labels=(1, 2), test_cases=0)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my-ct.yaml").write_text(block_after("worked-example:protocol"))
    commands = [line for line in block_after("worked-example:commands").splitlines() if line.strip()]
    assert [c.split()[:2] for c in commands] == [["jascl", "data"], ["jascl", "run"], ["jascl", "report"]]
    threads = torch.get_num_threads()
    try:
        for command in commands:
            args = shlex.split(command.replace("/data/my-ct", str(data)))[1:]
            args += [*FAST, "--no-progress", "--cache-dir", str(tmp_path / "cache")] if args[0] == "run" else []
            args += ["--cache-dir", str(tmp_path / "cache")] if args[0] == "data" else []
            code = main(args)
            captured = capsys.readouterr()
            assert code == 0, f"{command}: {captured.err}"
            if args[0] == "data":
                assert captured.out.rstrip().endswith("no problems found")
                assert "held out for testing (never trained on):" in captured.out  # 2 of the 8 cases
                assert "  mine (2): " in captured.out
    finally:
        torch.set_num_threads(threads)
    run = tmp_path / "runs" / "my-ct"
    assert sorted(p.name for p in run.iterdir() if p.is_dir()) == [
        "base",
        "base-stochastic-classifier",
        "jascl",
        "report",
        "vanilla",
    ]
    assert (run / "results.json").is_file() and (run / "report" / "report.html").is_file()


@pytest.mark.parametrize("marker", ["worked-example:protocol", "worked-example:commands"])
def test_the_page_holds_the_blocks(marker):
    assert block_after(marker).strip()
