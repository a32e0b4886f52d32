"""Atomic, durable file writes: what every run-folder file, checkpoint and cache entry is written with; and
:func:`load_yaml`, the YAML reader of the shipped data files (protocols, the paper's tables).

A reader (or a run resumed after SIGKILL or a power loss) sees the old file or the new one, never a
part and never an empty file under the final name. The order of operations (:func:`commit`) is:

1. the content goes to a temporary file in the target's folder and is flushed and ``fsync``-ed;
2. the folder is ``fsync``-ed, so the temporary file's entry is on disk;
3. one ``os.replace`` renames it onto the target;
4. the folder is ``fsync``-ed again, so the rename itself is on disk.

Without step 1 a file system that delays data writes (ext4 ``data=writeback``, XFS) can keep the rename of
step 3 and lose the data after a power cut, leaving a zero-length checkpoint; without step 4 the rename can
be lost and the old file come back. Folders cannot be opened for ``fsync`` on every platform (Windows);
there steps 2 and 4 are skipped.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

#: libyaml's C parser where PyYAML was built with it (it reads the same documents ~7x faster), else PyYAML's own
_SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def fsync_file(path: str | Path) -> None:
    """Flush ``path``'s data to disk (it is opened read-only, which ``fsync`` accepts on POSIX)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | Path) -> None:
    """Flush folder ``path``'s entries (creations, renames) to disk; a no-op where folders cannot be opened."""
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)
    try:
        fd = os.open(path, flags)
    except OSError:  # Windows: a folder cannot be opened
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on a folder; nothing more can be done there
        pass
    finally:
        os.close(fd)


def commit(tmp: str | Path, path: str | Path) -> None:
    """Make the finished temporary file ``tmp`` the file ``path``, durably (steps 1-4 of the module docstring).

    ``tmp`` must be in ``path``'s folder (a rename within one file system is atomic).
    """
    folder = Path(path).parent
    fsync_file(tmp)
    fsync_dir(folder)
    os.replace(tmp, path)
    fsync_dir(folder)


def atomic_write(path: str | Path, write: Callable[[Path], object], suffix: str = ".tmp") -> None:
    """Write ``path`` atomically and durably: ``write(tmp)`` fills a temporary file next to it, then :func:`commit`.

    The temporary file is removed if ``write`` or the commit fails (the target is then untouched). The file gets
    the permissions a plain ``open`` would give it (``0666`` less the umask), not ``mkstemp``'s ``0600``: run
    folders, reports and their figures are for everyone the umask allows.

    Args:
        write: writes the complete content to the path it is given (e.g. ``lambda p: save_file(t, str(p))``).
        suffix: ending of the temporary name, for writers that insist on one (``np.savez`` adds ``.npz``).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=suffix)
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        commit(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_dir(path: str | Path, write: Callable[[Path], object]) -> bool:
    """Create folder ``path`` atomically and durably: ``write(tmp)`` fills a temporary folder next to it, each of its
    files is ``fsync``-ed, then one rename makes it ``path``.

    A reader sees no folder or the complete one, never a part: a process killed while writing leaves only the
    temporary folder (named ``.<name>.tmp-<host>-<pid>-...``, see :func:`stale_temporary_dirs`). Folders are
    never replaced: if ``path`` appeared meanwhile (another process wrote the same content), the temporary
    folder is removed and ``path`` is left as it is.

    Returns:
        True if this call created ``path``, False if it existed already.
    """
    import shutil
    import socket

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.tmp-{socket.gethostname()}-{os.getpid()}-"))
    try:
        write(tmp)
        for f in tmp.iterdir():
            fsync_file(f)
        fsync_dir(tmp)
        try:
            os.rename(tmp, path)  # fails (and changes nothing) when path exists: folders are not replaced
        except OSError:
            if not path.is_dir():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
            return False
        fsync_dir(path.parent)
        return True
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def stale_temporary_dirs(folder: str | Path) -> list[Path]:
    """Temporary folders of :func:`atomic_write_dir` in ``folder`` left by processes of this host that no longer run
    (killed while writing): safe to remove."""
    import socket

    host = socket.gethostname()
    out = []
    for p in Path(folder).glob(".*.tmp-*"):
        head, _, rest = p.name.rpartition(".tmp-")
        parts = rest.split("-")
        if not p.is_dir() or len(parts) < 3 or "-".join(parts[:-2]) != host or not parts[-2].isdigit():
            continue
        try:
            os.kill(int(parts[-2]), 0)
        except ProcessLookupError:
            out.append(p)
        except OSError:  # the process exists (another user's): not stale
            pass
    return out


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` (UTF-8, newlines as given) to ``path`` atomically and durably, readable as the umask allows."""

    def write(tmp: Path) -> None:
        with open(tmp, "w", encoding="utf-8", newline="") as fh:
            fh.write(text)

    atomic_write(path, write)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically and durably."""
    atomic_write(path, lambda tmp: tmp.write_bytes(data))


def load_yaml(text: str) -> Any:
    """``yaml.safe_load(text)``, parsed by libyaml's C parser where PyYAML has it: the same objects, read ~7x
    faster (the 26 built-in protocols: 0.05 s of CPU instead of 0.34 s, which keeps ``jascl protocols`` under a
    second). A document the C parser refuses is parsed again by PyYAML's own, so that the ``yaml.YAMLError``
    (problem, line) is the one users have always seen."""
    try:
        return yaml.load(text, Loader=_SAFE_LOADER)  # a safe loader: plain data only
    except yaml.YAMLError:
        return yaml.safe_load(text)
