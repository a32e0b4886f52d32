"""Resumable, verified downloads of published files (``jascl data download``, ``jascl weights fetch``).

Nothing in jascl calls this module on its own: a file is fetched only by one of those two commands, and a run never
opens a network connection.

**Why not MONAI's downloader.** ``monai.apps.download_url`` (and ``download_and_extract`` on top of it) fetches with
``urllib.request.urlretrieve`` into a temporary folder that is deleted when the transfer fails, and it sends no
``Range`` header: an interrupted download of a 10 GB Decathlon task starts again from byte 0. jascl keeps the bytes
received in ``<file>.part`` and asks for the rest with ``Range: bytes=N-``, using the standard library's
``urllib`` (the smallest well-kept mechanism that does: no new dependency, and its default proxy handler honours
``HTTPS_PROXY`` / ``HTTP_PROXY`` / ``NO_PROXY``). MONAI is reused where it fits: archives are unpacked with
``monai.apps.utils.extractall`` (which refuses members that would land outside the target folder, and links), and
the Decathlon tasks' URLs and MD5s come from ``monai.apps.DecathlonDataset`` (:mod:`jascl.data.catalogue`).

**One file** (:func:`fetch`), in ``folder``:

1. ``<filename>`` exists: it was verified (or explicitly accepted) before; nothing is fetched.
2. ``<filename>.part`` holds N bytes: a ``Range: bytes=N-`` request. ``206 Partial Content`` from byte N is
   appended; ``200`` (a server that ignores ranges) starts the file again; ``416`` with ``Content-Range: bytes */N``
   means the part is already whole.
3. A transfer cut short (the connection closes before ``Content-Length`` bytes, a reset, a timeout) is a
   :class:`~jascl.errors.DataError` naming the bytes received; the part stays for the next run to resume.
4. A whole file is hashed once (MD5 and SHA-256 in one pass) and compared with the recorded checksum
   (:class:`Archive`; SHA-256 preferred). A match renames it to ``<filename>``. A mismatch is a one-line error and
   the file stays as ``.part``. Where no checksum is recorded the command refuses to pass the file silently: it
   prints the SHA-256 it computed and fails unless the caller accepts unverified files (``--no-verify``).
"""

from __future__ import annotations

import hashlib
import http.client
import logging
import os
import re
import shutil
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from jascl import __version__
from jascl.errors import ConfigError, DataError
from jascl.fileio import fsync_dir

CHUNK = 1 << 20  # bytes read and hashed at a time
TIMEOUT = 60.0  # seconds without data before a transfer counts as cut

#: environment variable of the default download folder (``--to``)
DATA_ENV = "JASCL_DATA"

#: where a recorded checksum comes from (``Archive.checksum_source``): published by the file's own host, or
#: recorded by others because the host publishes none
PUBLISHED, RECORDED = "published", "recorded"


@dataclass(frozen=True)
class Archive:
    """One published file: where it is and how to check it.

    Attributes:
        url: the official (or the host's mirror) download URL.
        filename: the name it is saved under.
        md5 / sha256: the checksum(s), lower-case hex; None where none is recorded. A ``sha256`` shorter than 64
            digits is a prefix (torch.hub's convention: ``<name>-<first hex digits of the SHA-256>.pth``).
        checksum_source: :data:`PUBLISHED` (by the host: MONAI's MSD table, OpenAI's URL) or :data:`RECORDED`
            (by others; the host publishes none), with who in ``checksum_note``.
        checksum_note: where the checksum was taken from, for the documentation.
        size: bytes, where recorded (display only; the checksum decides).
    """

    url: str
    filename: str
    md5: str | None = None
    sha256: str | None = None
    checksum_source: str = ""
    checksum_note: str = ""
    size: int | None = None

    @property
    def verified(self) -> bool:
        """Whether a checksum is recorded (the download is then verified)."""
        return bool(self.sha256 or self.md5)

    @property
    def checksum_kind(self) -> str:
        """The checksum recorded: SHA-256, SHA-256 prefix (torch.hub's file-name convention), MD5, or ""."""
        if self.sha256:
            return "SHA-256" if len(self.sha256) == 64 else "SHA-256 prefix"
        return "MD5" if self.md5 else ""


@dataclass(frozen=True)
class Fetched:
    """What :func:`fetch` did: the file, its SHA-256 (None when it was there already) and how it was checked
    ("verified", "accepted unverified", "accepted despite a mismatch", "present")."""

    path: Path
    sha256: str | None
    status: str


def download_folder(to: str | Path | None, sub: str = "", environ: Mapping[str, str] | None = None) -> Path:
    """The folder a download goes to: ``--to``, else ``$JASCL_DATA/<sub>``, as an absolute path.

    Raises:
        ConfigError: neither is given.
    """
    environ = os.environ if environ is None else environ
    if to:
        return Path(to).expanduser().absolute()
    if not environ.get(DATA_ENV):
        raise ConfigError(f"no download folder: pass --to DIR or set {DATA_ENV}")
    return (Path(environ[DATA_ENV]).expanduser() / sub).absolute()


def file_digests(path: Path) -> dict[str, str]:
    """``{"md5": ..., "sha256": ...}`` of a file, read once in :data:`CHUNK` blocks (archives are gigabytes)."""
    md5, sha = hashlib.md5(usedforsecurity=False), hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(CHUNK), b""):
            md5.update(block)
            sha.update(block)
    return {"md5": md5.hexdigest(), "sha256": sha.hexdigest()}


def fetch(
    archive: Archive,
    folder: str | Path,
    *,
    accept_unverified: bool = False,
    progress: bool = True,
    echo: Callable[[str], None] = print,
    timeout: float = TIMEOUT,
) -> Fetched:
    """Download ``archive`` into ``folder`` (resuming a ``.part``), verify it and give it its final name.

    Args:
        accept_unverified: ``--no-verify``: a file without a recorded checksum, or one whose checksum differs, is
            accepted (its SHA-256 is printed) instead of failing.
        progress: show a tqdm progress bar (on stderr).
        echo: where the one-line messages go.

    Raises:
        DataError: no connection, an HTTP error, a transfer cut short (the part is kept: rerun to resume), a
            checksum mismatch, or no checksum recorded without ``accept_unverified`` (the file is kept as ``.part``:
            a rerun with ``--no-verify`` does not fetch it again).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / archive.filename
    if final.is_file():
        echo(f"{final}: already downloaded (verified or accepted before); not fetched again")
        return Fetched(final, None, "present")
    part = final.with_name(final.name + ".part")
    _transfer(archive, part, progress=progress, timeout=timeout)
    digests = file_digests(part)
    status = _verify(archive, part, digests, accept_unverified, echo)
    os.replace(part, final)
    fsync_dir(folder)
    return Fetched(final, digests["sha256"], status)


def _verify(archive: Archive, part: Path, digests: dict[str, str], accept: bool, echo: Callable[[str], None]) -> str:
    sha = digests["sha256"]
    if not archive.verified:
        if accept:
            echo(f"{archive.filename}: no checksum is recorded; accepted unverified (--no-verify); SHA-256 {sha}")
            return "accepted unverified"
        raise DataError(
            f"{part}: no checksum is recorded for {archive.filename}, so it cannot be verified; its SHA-256 is "
            f"{sha}: compare it with a trusted source, then rerun with --no-verify to accept it (the file is kept "
            "and not fetched again)"
        )
    kind = archive.checksum_kind
    want = (archive.sha256 or archive.md5 or "").lower()
    got = digests["sha256"][: len(want)] if archive.sha256 else digests["md5"]
    if got == want:
        echo(f"{archive.filename}: {kind} verified ({archive.checksum_source}); SHA-256 {sha}")
        return "verified"
    if accept:
        echo(f"{archive.filename}: {kind} MISMATCH accepted (--no-verify): expected {want}, got {got}; SHA-256 {sha}")
        return "accepted despite a mismatch"
    raise DataError(
        f"{part}: {kind} checksum mismatch for {archive.filename} (expected {want}, got {got}); the file is kept: "
        "rerun to resume if the download was cut short, or delete it to fetch it again"
    )


def _content_range(header: str | None) -> tuple[int | None, int | None]:
    """(first byte, total size) of a ``Content-Range`` header (``bytes 100-199/200``, ``bytes */200``)."""
    match = re.fullmatch(r"\s*bytes\s+(?:(\d+)-\d+|\*)/(\d+|\*)\s*", header or "")
    if not match:
        return None, None
    first, total = match.groups()
    return (int(first) if first else None), (int(total) if total and total != "*" else None)


def _open(url: str, have: int, timeout: float):
    """The response for the bytes from ``have`` on.

    A fresh default opener per request: its proxy handler reads ``HTTPS_PROXY`` / ``HTTP_PROXY`` / ``NO_PROXY`` as
    they are now (``urllib.request.urlopen`` keeps the opener, and so the proxies, of its first call).
    """
    headers = {"User-Agent": f"jascl/{__version__}"}
    if have:
        headers["Range"] = f"bytes={have}-"
    return urllib.request.build_opener().open(urllib.request.Request(url, headers=headers), timeout=timeout)


def _transfer(archive: Archive, part: Path, *, progress: bool, timeout: float) -> None:
    """Fill ``part`` with the whole file, resuming from its current size."""
    from tqdm import tqdm

    url = archive.url
    have = part.stat().st_size if part.is_file() else 0
    try:
        response = _open(url, have, timeout)
    except urllib.error.HTTPError as exc:
        if exc.code == 416 and have and _content_range(exc.headers.get("Content-Range"))[1] == have:
            return  # the part holds the whole file already (a finished download that was not yet accepted)
        raise DataError(
            f"{url}: HTTP {exc.code} {exc.reason}; the file may have moved (check the source page)"
        ) from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise DataError(
            f"{url}: cannot connect ({reason}); check the network, or set HTTPS_PROXY if you reach it through a "
            "proxy, then rerun"
        ) from None
    with response:
        start = 0
        if have and response.status == 206:
            start = _content_range(response.headers.get("Content-Range"))[0] or 0
            if start != have:  # a server that answers another range than asked: take the whole file again
                response.close()
                part.unlink()
                return _transfer(archive, part, progress=progress, timeout=timeout)
        length = response.headers.get("Content-Length")
        total = start + int(length) if length and length.isdigit() else archive.size
        received, cut = start, None
        with (
            open(part, "ab" if start else "wb") as out,
            tqdm(
                total=total,
                initial=start,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                desc=archive.filename,
                disable=not progress,
                leave=False,
            ) as bar,
        ):
            try:
                while block := response.read(CHUNK):
                    out.write(block)
                    received += len(block)
                    bar.update(len(block))
            except (http.client.HTTPException, OSError) as exc:  # reset, timeout, incomplete chunked body
                cut = f"{type(exc).__name__}: {exc}".rstrip(": ")
            out.flush()
            os.fsync(out.fileno())
    if cut is not None or (total is not None and received < total):
        of = f" of {total:,}" if total is not None else ""
        raise DataError(
            f"{url}: download interrupted after {received:,}{of} bytes ({cut or 'connection closed early'}); the "
            f"bytes received are kept in {part}: rerun the same command to resume"
        )


def extract(path: str | Path, into: str | Path) -> list[Path]:
    """Unpack the archive ``path`` (``.zip``, ``.tar``, ``.tar.gz``) into ``into`` with MONAI's ``extractall``.

    The archive is unpacked into a fresh hidden folder beside its destination first and its top-level entries are
    then moved into ``into``, so an interrupted extraction never leaves a half-filled dataset under its final name.
    A marker file ``.<archive>.extracted`` records a finished extraction; a rerun skips it.

    Returns:
        the top-level entries the archive put into ``into`` (all of them, also when skipped).

    Raises:
        DataError: the archive is not readable, holds an unsafe member, or a top-level entry exists already in
            ``into`` without having been put there by this archive.
    """
    from monai.apps.utils import extractall

    path, into = Path(path), Path(into)
    marker = into / f".{path.name}.extracted"
    if marker.is_file():
        return [into / name for name in marker.read_text().splitlines() if name]
    staging = into / f".{path.name}.extracting"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    monai_log = logging.getLogger("monai.apps")
    level = monai_log.level
    monai_log.setLevel(logging.WARNING)  # its INFO line would name the hidden staging folder
    try:
        extractall(path, staging, has_base=False)
    except Exception as exc:  # tarfile / zipfile / MONAI's unsafe-member ValueError
        shutil.rmtree(staging, ignore_errors=True)
        raise DataError(f"{path}: cannot unpack ({type(exc).__name__}: {exc}); delete it to fetch it again") from None
    finally:
        monai_log.setLevel(level)
    entries = sorted(staging.iterdir())
    clash = [e.name for e in entries if (into / e.name).exists()]
    if clash:
        shutil.rmtree(staging, ignore_errors=True)
        raise DataError(
            f"{into / clash[0]}: exists already and was not unpacked from {path.name}; move it away or choose "
            "another --to folder"
        )
    for entry in entries:
        os.replace(entry, into / entry.name)
    staging.rmdir()
    marker.write_text("".join(f"{e.name}\n" for e in entries))
    fsync_dir(into)
    return [into / e.name for e in entries]
