"""What a run checks before any work, and the lock that keeps a run folder to one run at a time.

* :func:`check_device` -- ``--device cuda`` on a machine whose torch sees no GPU, a GPU index it does not
  have, ``mps`` without Metal: one line, before any data is read.
* :func:`check_writable` -- the run folder (or the nearest folder above it that exists) can be written
  (a read-only file system, a folder of someone else's, a file in the way).
* :func:`backbone_problem` -- the backbone exists, takes its ``backbone_args`` and the ``patch_size``
  (built on PyTorch's meta device: no memory, no weights), naming the smallest patch that works.
* :class:`RunLock` -- an exclusive ``fcntl`` lock on ``<run>/.lock`` for the run's lifetime; its file names
  the holder's process id. The kernel releases the lock when the process ends however it ends, so a lock
  left by a killed run never blocks ``--resume``; a second run, or ``jascl report`` writing into the folder,
  gets a one-line error naming the holder.

Each raises :class:`~jascl.errors.ConfigError` (exit code 2) with one line naming the option and the fix.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path
from types import TracebackType

from jascl.errors import ConfigError

#: the lock file in a run folder (hidden: it is no result)
LOCK_FILE = ".lock"


def check_device(device: str | None, option: str = "--device") -> None:
    """Refuse a device this machine's torch cannot use (``auto`` and ``cpu`` always pass).

    Raises:
        ConfigError: ``--device cuda: torch sees no CUDA GPU on this machine ...``.
    """
    name = str(device or "auto")
    if name in ("auto", "cpu"):
        return
    import torch

    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError):
        raise ConfigError(f"{option} {name}: not a device; use auto, cpu, cuda, cuda:1, ... or mps") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            build = "" if torch.version.cuda else " (this torch build has no CUDA support)"
            raise ConfigError(
                f"{option} {name}: torch sees no CUDA GPU on this machine{build}; use --device cpu, or auto "
                "(a GPU when there is one), or check CUDA_VISIBLE_DEVICES and the driver"
            )
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise ConfigError(f"{option} {name}: this machine has {count} GPU(s) (cuda:0 to cuda:{count - 1})")
    elif dev.type == "mps":
        if not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
            raise ConfigError(f"{option} {name}: Metal (mps) is not available to torch here; use --device cpu")


def check_writable(out: str | Path, option: str = "--out") -> None:
    """Refuse a run folder that cannot be created or written, before anything is computed.

    The folder itself is probed when it exists, else the nearest folder above it that does (where it will be
    created); the probe file is removed at once, and nothing else is created.
    """
    out = Path(out)
    target = out
    while not target.exists() and target != target.parent:
        target = target.parent
    if not target.is_dir():
        raise ConfigError(f"{option} {out}: {target} is a file, not a folder; choose another folder")
    try:
        fd, probe = tempfile.mkstemp(prefix=".jascl-write-test-", dir=target)
    except OSError as exc:
        why = "read-only file system" if exc.errno == errno.EROFS else (exc.strerror or type(exc).__name__)
        raise ConfigError(f"{option} {out}: cannot write in {target} ({why}); choose a writable folder") from None
    os.close(fd)
    os.unlink(probe)


def backbone_problem(protocol, config) -> str | None:
    """What keeps ``config``'s backbone from training ``protocol`` at ``config.patch_size``, as one line, or None.

    The backbone is built on the meta device (shapes only); an unknown name or backbone arguments it does not
    take are raised as the registry raises them. A backbone that cannot be built on the meta device (one that
    reads files while it is built) is not checked here: the trainer checks it when it builds it.
    """
    if protocol.task != "segmentation":
        return None
    from jascl.networks.registry import BACKBONES

    BACKBONES.get(config.backbone)  # one line for an unknown name (with "did you mean")
    patch = config.patch_size
    if patch is not None and len(patch) != protocol.spatial_dims:
        return f"patch_size={list(patch)}: needs {protocol.spatial_dims} entries for protocol {protocol.name}"
    if patch is None:
        return None
    import torch

    from jascl.networks.base import create_segmenter

    try:
        with torch.device("meta"):
            model = create_segmenter(
                config.backbone, protocol.spatial_dims, protocol.in_channels, 2, **config.backbone_args
            )
    except ConfigError:
        raise
    except Exception:  # noqa: BLE001  (files, downloads refused, meta-unfriendly code: the trainer checks later)
        return None
    try:
        model.backbone.check_input_size(tuple(int(p) for p in patch), "patch_size")
    except ConfigError as exc:
        return f"{exc} (backbone {config.backbone})"
    return None


def preflight(out: str | Path, protocol, config) -> None:
    """Everything a run checks before it creates its folder: the folder can be written, the device exists, the
    backbone takes the patch size (:func:`check_writable`, :func:`check_device`, :func:`backbone_problem`)."""
    check_writable(out)
    check_device(config.device, "device")
    problem = backbone_problem(protocol, config)
    if problem is not None:
        raise ConfigError(problem)


class RunLock:
    """An exclusive lock on a run folder for as long as the ``with`` block runs.

    Args:
        folder: the run folder (created if missing: the lock file lives in it).
        what: what takes it, for the holder's line ("jascl run", "jascl report").

    Raises:
        ConfigError: another process holds it: ``<folder>: in use by <what> (pid N, since ...); ...``.
    """

    def __init__(self, folder: str | Path, what: str = "jascl run") -> None:
        self.folder = Path(folder)
        self.what = what
        self._fd: int | None = None

    def __enter__(self) -> RunLock:
        try:
            import fcntl
        except ImportError:  # Windows: no advisory locks; nothing to hold
            return self
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / LOCK_FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "another process"
            os.close(fd)
            raise ConfigError(
                f"{self.folder}: in use by {holder}; wait for it to finish (or stop it: it checkpoints and can be "
                "resumed), or use another --out"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{self.what} (pid {os.getpid()})\n".encode(), 0)
        self._fd = fd
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.release()

    def release(self) -> None:
        """Unlock (closing the file releases the lock); the file stays, naming no one."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.ftruncate(fd, 0)
        finally:
            os.close(fd)


class RunFolder:
    """A run folder for the length of one run: locked (:class:`RunLock`) and, if the run created it and fails
    before it wrote ``run.json`` (a wrong or unset root, data that fails to load, a bad patch size), removed
    again, so that a failed start leaves nothing behind. A folder that holds ``run.json`` is kept (the run can be
    resumed; its ``log.txt`` says why it stopped).

    Args:
        folder: the run folder.
        hold: False for a process that must not lock or remove (another rank, a launcher's cell job).
    """

    def __init__(self, folder: str | Path, hold: bool = True, what: str = "jascl run") -> None:
        self.folder = Path(folder)
        self.hold = hold
        self.created = hold and not self.folder.exists()
        self.lock = RunLock(self.folder, what)

    def open(self) -> None:
        """Create (if need be) and lock the folder."""
        if self.hold:
            self.lock.__enter__()

    def close(self, failed: bool) -> None:
        """Unlock; remove the folder when this run created it and ``failed`` before writing ``run.json``."""
        if not self.hold:
            return
        self.lock.release()
        if failed and self.created and not (self.folder / "run.json").exists():
            shutil.rmtree(self.folder, ignore_errors=True)
