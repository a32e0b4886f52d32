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

import pytest

HEAVY = ("torch", "monai", "torchvision", "matplotlib", "segmentation_models_pytorch", "open_clip", "scipy")


def _fresh(code: str) -> dict:
    """Run ``code`` in a fresh interpreter; it prints one JSON line last, which is returned."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_importing_the_cli_and_the_registries_packages_imports_no_heavy_library():
    """The packages whose names the listings read (their modules are imported when first used)."""
    heavy = _fresh(
        f"""
        import json, sys
        import jascl.cli, jascl.data, jascl.methods, jascl.networks
        print(json.dumps({{"heavy": [m for m in {HEAVY!r} if m in sys.modules]}}))
        """
    )
    assert heavy == {"heavy": []}


def test_help_the_listing_commands_and_input_errors_import_no_heavy_library():
    """Each command in turn (its exit code, what it has imported, whether it printed); a heavy library is charged
    to the first command that imports it. ``jascl run`` reports a bad protocol before importing torch."""
    commands = {
        "--help": 0,
        "methods": 0,
        "methods --task detection": 0,
        "methods --paper": 0,
        "backbones": 0,
        "protocols": 0,
        "protocols synthetic-2d": 0,
        "run --protocol no-such-protocol": 2,
    }
    found = _fresh(
        f"""
        import contextlib, io, json, sys
        from jascl.cli import main

        found = {{}}
        for command in {list(commands)!r}:
            out = io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                code = main(command.split())
            found[command] = [code, [m for m in {HEAVY!r} if m in sys.modules], len(out.getvalue()) > 0]
        print(json.dumps(found))
        """
    )
    assert found == {command: [code, [], True] for command, code in commands.items()}


@pytest.mark.slow
def test_the_nifti_modules_import_first_in_a_fresh_interpreter():
    # jascl.data.medical -> layouts.base -> layouts/__init__ -> msd -> volume_checks: a name volume_checks took
    # from medical (not yet defined while medical was importing) once broke `import jascl.data.medical` as the
    # first import (the docs build's protocol reference page); the shared pieces now live in jascl.data.nifti
    for module in ("jascl.data.medical", "jascl.data.volume_checks", "jascl.data.layouts.msd"):
        done = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True)
        assert done.returncode == 0, (module, done.stderr.strip().splitlines()[-1:])
