"""Start-up (issue 33): the command line parses its arguments and lists what is registered without importing a
heavy library, so ``jascl --help``, ``jascl methods``, ``jascl backbones`` and ``jascl protocols`` take well under
a second (importing torch alone takes seconds on a small machine; MONAI pulls in torchvision and matplotlib).
Checked by what a fresh interpreter has imported (``sys.modules``), which, unlike a time, does not depend on the
machine's load."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

HEAVY = ("torch", "monai", "torchvision", "matplotlib", "segmentation_models_pytorch", "open_clip", "scipy")


def _fresh(code: str) -> dict:
    """Run ``code`` in a fresh interpreter; it prints one JSON line last, which is returned."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_importing_the_cli_imports_no_heavy_library():
    heavy = _fresh(
        f"""
        import json, sys
        import jascl.cli
        print(json.dumps({{"heavy": [m for m in {HEAVY!r} if m in sys.modules]}}))
        """
    )
    assert heavy == {"heavy": []}


def test_help_and_the_listing_commands_import_no_heavy_library():
    """Each command in turn; a heavy library is charged to the first command that imports it."""
    commands = [
        ["--help"],
        ["methods"],
        ["methods", "--task", "detection"],
        ["methods", "--paper"],
        ["backbones"],
        ["protocols"],
        ["protocols", "synthetic-2d"],
    ]
    found = _fresh(
        f"""
        import contextlib, io, json, sys
        from jascl.cli import main

        found = {{}}
        for argv in {commands!r}:
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                code = main(argv)
            found[" ".join(argv)] = [code, [m for m in {HEAVY!r} if m in sys.modules], len(out.getvalue()) > 0]
        print(json.dumps(found))
        """
    )
    assert found == {" ".join(argv): [0, [], True] for argv in commands}
