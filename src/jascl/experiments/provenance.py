"""Where a run's numbers came from: library versions, devices, the command line, the date and the git revision
of the jascl source (``environment.json`` of every run folder; the report's versions section shows them)."""

from __future__ import annotations

import datetime
import functools
import platform
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from jascl import __version__


def environment() -> dict:
    """Versions and devices of the machine that ran: library versions, CUDA/cuDNN if any, GPU count and names."""
    import monai
    import numpy
    import torch

    cuda = torch.cuda.is_available()
    env = {
        "jascl": __version__,
        "torch": torch.__version__,
        "monai": monai.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "numpy": numpy.__version__,
        "cuda": torch.version.cuda if cuda else None,
        "torch_built_with_cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "device_count": torch.cuda.device_count() if cuda else 0,
    }
    if cuda:
        env["devices"] = [torch.cuda.get_device_name(i) for i in range(env["device_count"])]
    env["command"] = command_line()
    env["date"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    env["git_revision"] = git_revision()
    return env


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command that started this process, as a user would type it (``jascl run ...``)."""
    argv = list(sys.argv if argv is None else argv)
    if not argv:
        return ""
    name = Path(argv[0]).name
    if name == "jascl":
        return shlex.join(["jascl", *argv[1:]])
    if name == "__main__.py" and Path(argv[0]).parent.name == "jascl":
        return shlex.join(["python", "-m", "jascl", *argv[1:]])
    return shlex.join(argv)


@functools.cache
def git_revision() -> str | None:
    """The git commit of the jascl source that ran (``+dirty`` with uncommitted changes), None outside a checkout.

    Asked once per process: the source that runs is the one imported at start (an edit made while a long
    ``reproduce`` or a test session runs does not change the code it runs), and the two ``git`` calls cost
    10 ms per run folder otherwise."""
    import subprocess

    source = Path(__file__).resolve().parent
    try:
        rev = subprocess.run(
            ["git", "-C", str(source), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(source), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return rev + ("+dirty" if dirty else "") if rev else None
