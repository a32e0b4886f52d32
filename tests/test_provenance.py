"""A run's provenance: the command as typed, the date, the git revision of the jascl source."""

import re
import subprocess

from jascl.experiments.provenance import command_line, environment, git_revision


def test_command_line_as_a_user_types_it():
    assert command_line(["/venv/bin/jascl", "run", "--set", "epochs_base=5", "--out", "my runs"]) == (
        "jascl run --set epochs_base=5 --out 'my runs'"
    )
    assert command_line(["/src/jascl/__main__.py", "report", "runs/x"]) == "python -m jascl report runs/x"
    assert command_line(["/usr/bin/pytest", "-q"]) == "/usr/bin/pytest -q"


def test_environment_records_date_and_revision():
    env = environment()
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC", env["date"])
    rev = git_revision()
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        head = None
    if head:  # the tests run from a checkout: its HEAD, marked dirty if files differ
        assert rev is not None and rev.split("+")[0] == head
    assert env["git_revision"] == rev


def test_the_revision_is_asked_of_git_once_per_process(monkeypatch):
    calls = []
    real = subprocess.run
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: calls.append(a) or real(*a, **k))
    git_revision.cache_clear()
    first = git_revision()
    asked = len(calls)  # two git calls in a checkout, one that fails without git
    assert asked in (1, 2)
    assert git_revision() == first and len(calls) == asked
    assert git_revision.cache_info().hits == 1
