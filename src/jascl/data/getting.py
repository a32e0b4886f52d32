"""``jascl data download NAME``: fetch, verify and unpack a dataset of :data:`~jascl.data.catalogue.CATALOGUE` into
the layout jascl reads, or say how to get one that needs a registration.

A download lands in ``DIR/NAME/`` (``DIR``: ``--to``, else ``$JASCL_DATA``): the archives, then what they unpack to,
then ``.jascl-ready`` once every step is done; the root is the folder holding the entry's marker file
(``dataset.json``, ``meta.csv`` ...). Every step can be rerun: a finished archive is not fetched again, a finished
extraction is not repeated, and a ready dataset only prints its root line. With ``$JASCL_DATA`` set, a run finds the
root without ``--root`` (:func:`jascl.data.real.resolve_roots`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

from jascl.data.catalogue import DatasetEntry, data_folder, find_root, get_entry, protocol_roots
from jascl.data.real.roots import env_var
from jascl.download import extract, fetch
from jascl.errors import ConfigError, DataError
from jascl.fileio import atomic_write_text

READY = ".jascl-ready"


def root_line(name: str, root: Path) -> str:
    """The ``--root NAME=PATH`` option to pass to ``jascl run`` / ``jascl data check``."""
    return f"--root {name}={root}"


def download_dataset(
    name: str,
    to: str | Path | None = None,
    *,
    no_verify: bool = False,
    progress: bool = True,
    echo: Callable[[str], None] = print,
) -> Path | None:
    """Fetch, verify, unpack and prepare dataset ``name``; print its root line. A manual entry prints how to get it.

    Args:
        to: the download folder (default ``$JASCL_DATA``); the dataset goes into ``to/NAME/``.
        no_verify: accept archives without a recorded checksum (or with a mismatch), printing their SHA-256.

    Returns:
        the dataset root, or None for a manual entry (nothing was downloaded).

    Raises:
        ConfigError: an unknown name, or no download folder.
        DataError: a failed, interrupted or unverifiable download (one line; a rerun resumes), or an archive that
            does not unpack into the layout expected.
    """
    entry = get_entry(name)
    if not entry.downloadable:
        for line in manual_instructions(entry, to):
            echo(line)
        return None
    folder = data_folder(to) / entry.name
    ready = folder / READY
    if not ready.is_file():
        echo(f"{entry.name}: {entry.title} -> {folder}")
        echo(f"licence: {entry.licence}")
        for archive in entry.resolved_archives():
            fetched = fetch(archive, folder, accept_unverified=no_verify, progress=progress, echo=echo)
            echo(f"unpacking {fetched.path.name} ...")
            extract(fetched.path, folder)
        if entry.prepare == "verse-index":
            write_verse_index(folder, echo)
    root = find_root(entry, folder)
    if root is None:
        raise DataError(
            f"{folder}: no {entry.marker} in it or two levels down, so it holds no {entry.layout} root (the archive's "
            f"layout may have changed, see {entry.source}, or the unpacked files were moved); delete its .jascl-ready "
            "and .*.extracted files to unpack the kept archives again"
        )
    if not ready.is_file():
        atomic_write_text(ready, f"{root}\n")
    echo(f"{entry.name} is ready at {root}")
    echo(root_line(entry.name, root))
    echo(_check_hint(entry, root))
    return root


def _check_hint(entry: DatasetEntry, root: Path) -> str:
    users = protocol_roots().get(entry.name, {})
    if users:
        protocol = sorted(users)[0]
        return f"check it: jascl data check --protocol {protocol} {root_line(entry.name, root)} (with its other roots)"
    if entry.layout == "coco":
        return (
            f"check it: jascl data check --coco {root / 'annotations' / 'instances_val2017.json'} "
            f"--images {root / 'val2017'}"
        )
    return f"use it in a protocol of yours with layout {entry.layout} and root {entry.name}"


def manual_instructions(entry: DatasetEntry, to: str | Path | None = None) -> list[str]:
    """What ``data download`` prints for a dataset it cannot fetch: where to register, which archive, where to
    unpack it and the root line (no network is used)."""
    try:
        where = str(data_folder(to) / entry.name)
    except ConfigError:  # no --to and no JASCL_DATA: the instructions still apply, with a placeholder
        where = f"DIR/{entry.name}"
    users = protocol_roots().get(entry.name, {})
    protocol = sorted(users)[0] if users else None
    lines = [
        f"{entry.name}: {entry.title}",
        f"jascl cannot download it: {entry.access}; nothing was fetched.",
        f"licence: {entry.licence}",
        f"1. register: {entry.register}",
        f"2. fetch: {entry.fetch}",
        f"3. unpack into {where}: {entry.unpack}",
        f"4. pass --root {entry.name}=ROOT with ROOT the folder step 3 names (or set {env_var(entry.name)}=ROOT)",
    ]
    if protocol:
        lines.append(
            f"5. check it: jascl data check --protocol {protocol} --root {entry.name}=PATH (with its other roots)"
        )
    if entry.note:
        lines.append(f"note: {entry.note}")
    return lines


#: VerSe's vertebra labels (github.com/anjany/verse, README "Data"): 1-7 C1-C7, 8-19 T1-T12, 20-25 L1-L6,
#: 26 sacrum and 27 coccyx (not labelled in the data), 28 an additional 13th thoracic vertebra (T13)
VERSE_LABELS = {
    "background": 0,
    **{f"C{i}": i for i in range(1, 8)},
    **{f"T{i}": 7 + i for i in range(1, 13)},
    **{f"L{i}": 19 + i for i in range(1, 7)},
    "sacrum": 26,
    "coccyx": 27,
    "T13": 28,
}
_CT = "_ct.nii.gz"
_MASK = "_seg-vert_msk.nii.gz"


def write_verse_index(folder: Path, echo: Callable[[str], None] = print) -> Path:
    """Write ``folder/dataset.json``: an nnU-Net v2 ``dataset`` mapping over VerSe's own folders.

    VerSe's complete release keeps each scan as ``<split>/rawdata/<subject>/<scan>_ct.nii.gz`` and its mask as
    ``<split>/derivatives/<subject>/<scan>_seg-vert_msk.nii.gz``; the ``msd`` layout reads the mapping
    (case ``<scan>`` -> ``{"images": [ct], "label": mask}``, paths relative to ``folder``) without copying a file.
    Scans without a mask are left out and counted.

    Raises:
        DataError: no scan with a mask was found.
    """
    cases: dict[str, dict] = {}
    unpaired = 0
    for ct in sorted(folder.glob(f"**/rawdata/*/*{_CT}")):
        if any(part.startswith(".") for part in ct.relative_to(folder).parts):
            continue
        scan = ct.name[: -len(_CT)]
        masks = sorted(ct.parents[2].glob(f"derivatives/{ct.parent.name}/{scan}{_MASK}"))
        if not masks:
            unpaired += 1
            continue
        case = re.sub(r"[^A-Za-z0-9_.-]", "_", scan)
        cases[case] = {"images": [ct.relative_to(folder).as_posix()], "label": masks[0].relative_to(folder).as_posix()}
    if not cases:
        raise DataError(
            f"{folder}: no VerSe scan (rawdata/<subject>/<scan>{_CT}) with its mask (derivatives/<subject>/<scan>"
            f"{_MASK}) was found; the archives' layout may have changed (see github.com/anjany/verse)"
        )
    meta = {
        "name": "VerSe",
        "description": "index of VerSe's own folders written by jascl data download",
        "channel_names": {"0": "CT"},
        "labels": VERSE_LABELS,
        "file_ending": ".nii.gz",
        "numTraining": len(cases),
        "dataset": cases,
    }
    path = folder / "dataset.json"
    atomic_write_text(path, json.dumps(meta, indent=1) + "\n")
    echo(f"{path}: indexed {len(cases)} VerSe scans" + (f" ({unpaired} without a mask left out)" if unpaired else ""))
    return path
