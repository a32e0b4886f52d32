"""K-shot manifests: the sample ids of every split of every session, written into each run folder and reusable
(``--split-manifest``) so that two runs see exactly the same few shots.

A session entry lists ``train``, ``test``, ``unlabelled`` (when the session has a pool) and ``validation`` (when it
has validation samples). Manifests written before validation samples existed have no ``validation`` lists and
still load: their sessions then have no validation samples (model selection keeps the last epoch, with a warning).

A session that borrows unlabelled samples from other sources (``unlabelled_sources``) lists them among its
``unlabelled`` ids and again, by source, under ``unlabelled_sources``: ``[{"dataset": "ts", "ids": [...]}, ...]``
(``"domain"`` on synthetic protocols, whose borrowed ids are ``s<t>-<name>/extra-<domain>/<i>``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from jascl.data.real.selection import SessionPlan, split_ref
from jascl.data.real.sources import DatasetSource
from jascl.data.synthetic import extra_split
from jascl.data.types import SessionData
from jascl.errors import DataError
from jascl.protocols.schema import Protocol, SessionSpec

MANIFEST_FORMAT = 2


def manifest_dict(protocol: Protocol, data: Sequence[SessionData], roots: Mapping[str, Path] | None = None) -> dict:
    """The K-shot manifest of a run: sample ids of every split, per session (written as ``manifest.json``)."""
    manifest: dict[str, Any] = {
        "format": MANIFEST_FORMAT,
        "protocol": protocol.name,
        "seed": protocol.seed,
        "sessions": [],
    }
    if protocol.uses_datasets:
        manifest["datasets"] = {
            n: {"layout": s.layout, "root": s.root, "path": str(roots[s.root]) if roots and s.root in roots else None}
            for n, s in protocol.datasets.items()
        }
    for s, d in zip(protocol.sessions, data):
        entry: dict[str, Any] = {
            "session": s.index,
            "name": s.name,
            "shots": s.shots if s.shots is not None else "all",
            "train": list(d.train.ids),
            "test": list(d.test.ids),
        }
        if s.sources:
            entry["sources"] = [{"dataset": src.dataset, "classes": list(src.classes)} for src in s.sources]
        if d.unlabelled is not None:
            entry["unlabelled"] = list(d.unlabelled.ids)
        if s.unlabelled_sources:
            entry["unlabelled_sources"] = borrowed_ids(s, d.unlabelled.ids if d.unlabelled is not None else [])
        if d.validation is not None:
            entry["validation"] = list(d.validation.ids)
        manifest["sessions"].append(entry)
    return manifest


def borrowed_ids(session: SessionSpec, ids: Sequence[str]) -> list[dict[str, Any]]:
    """The pool ids ``session`` borrowed, by source: ``[{"dataset" | "domain": name, "ids": [...]}, ...]``.

    A borrowed sample is known by its id: ``<dataset>/<record id>`` for a dataset entry the session
    does not read itself, ``s<t>-<name>/extra-<domain>/<i>`` for a synthetic domain.
    """
    out: list[dict[str, Any]] = []
    for src in session.unlabelled_sources:
        if src.dataset is not None:
            mine = [i for i in ids if split_ref_or_none(i) == src.dataset]
            out.append({"dataset": src.dataset, "ids": mine})
        else:
            middle = extra_split(str(src.domain))
            mine = [i for i in ids if i.split("/")[1:2] == [middle]]
            out.append({"domain": src.domain, "ids": mine})
    return out


def split_ref_or_none(ref: str) -> str | None:
    """The dataset entry of a sample id ``<dataset>/<record id>`` (None for another kind of id)."""
    try:
        return split_ref(ref)[0]
    except ValueError:
        return None


def load_manifest(path: str | Path, protocol: Protocol) -> dict:
    """Read a manifest and check that it belongs to ``protocol`` (name, sessions, shots).

    Raises:
        DataError: unreadable, or made for another protocol (one line naming the file and the difference).
    """
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{p}: split manifest not found; give the manifest.json of an earlier run folder")
    try:
        m = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"{p}: not a valid manifest ({exc}); give the manifest.json of an earlier run folder") from None
    if not isinstance(m, dict) or not isinstance(m.get("sessions"), list):
        raise DataError(f"{p}: not a manifest (no 'sessions' list); give the manifest.json of an earlier run folder")
    fix = "use a manifest written by a run of this protocol"
    if m.get("protocol") != protocol.name:
        raise DataError(f"{p}: made for protocol {m.get('protocol')!r}, not {protocol.name!r}; {fix}")
    sessions = m["sessions"]
    if len(sessions) != len(protocol.sessions):
        raise DataError(
            f"{p}: has {len(sessions)} sessions, protocol {protocol.name} has {len(protocol.sessions)}; {fix}"
        )
    for s, entry in zip(protocol.sessions, sessions):
        if not isinstance(entry, dict) or not all(isinstance(entry.get(k), list) for k in ("train", "test")):
            raise DataError(f"{p}: sessions[{s.index}] lacks 'train' / 'test' id lists; {fix}")
        if entry.get("name") != s.name:
            raise DataError(f"{p}: sessions[{s.index}] is {entry.get('name')!r}, the protocol's is {s.name!r}; {fix}")
        shots = s.shots if s.shots is not None else "all"
        if entry.get("shots") != shots:
            raise DataError(
                f"{p}: sessions[{s.index}] ({s.name}) was selected with shots={entry.get('shots')}, "
                f"the protocol asks for shots={shots}; {fix}"
            )
        if (entry.get("unlabelled") is not None) != s.has_unlabelled_pool:
            raise DataError(
                f"{p}: sessions[{s.index}] ({s.name}) unlabelled pool does not match the protocol's "
                f"(unlabelled={s.unlabelled}, unlabelled_per_class={s.unlabelled_per_class}, "
                f"unlabelled_sources={s.unlabelled_extra} samples); {fix}"
            )
        asked = {u.name: u.count for u in s.unlabelled_sources if u.count}
        listed = {
            str(b.get("dataset", b.get("domain"))): len(b.get("ids") or [])
            for b in entry.get("unlabelled_sources") or []
            if isinstance(b, dict) and b.get("ids")
        }
        if asked != listed:
            raise DataError(
                f"{p}: sessions[{s.index}] ({s.name}) borrows unlabelled samples {listed or 'from no other source'}, "
                f"the protocol's unlabelled_sources ask for {asked or 'none'}; {fix}"
            )
        validation = entry.get("validation")
        if validation is not None and not isinstance(validation, list):
            raise DataError(f"{p}: sessions[{s.index}].validation must be a list of sample ids; {fix}")
        if validation is not None and not s.validation:
            raise DataError(
                f"{p}: sessions[{s.index}] ({s.name}) lists validation samples, the protocol asks for none "
                f"(validation=0); {fix}"
            )
    return m


def plans_from_manifest(
    manifest: dict, protocol: Protocol, sources: Mapping[str, DatasetSource], source_path: str = "manifest"
) -> list[SessionPlan]:
    """Session plans read from a checked manifest; every id must exist and come from the session's sources (or, in
    the unlabelled pool, from a dataset of its ``unlabelled_sources``: never a test, labelled or validation sample)."""
    plans = []
    test_ids = {ref for e in manifest["sessions"] for ref in e["test"]}
    labelled_ids = {ref for e in manifest["sessions"] for k in ("train", "validation") for ref in e.get(k) or []}
    for s, entry in zip(protocol.sessions, manifest["sessions"]):
        allowed = {src.dataset for src in s.sources}
        lenders = {str(u.dataset) for u in s.unlabelled_sources}
        splits = {k: entry.get(k) for k in ("train", "test", "unlabelled", "validation")}
        for split, refs in splits.items():
            for ref in refs or []:
                try:
                    d, rid = split_ref(str(ref))
                except ValueError:
                    raise DataError(
                        f"{source_path}: sessions[{s.index}].{split}: {ref!r} is not a "
                        "'<dataset>/<record id>' sample id; use a manifest of this protocol"
                    ) from None
                if split == "unlabelled" and d in lenders:
                    if ref in labelled_ids:
                        raise DataError(
                            f"{source_path}: sessions[{s.index}].unlabelled: {ref} is borrowed from dataset {d} but is "
                            "a labelled training or validation sample of a session; use a manifest of this protocol"
                        )
                elif d not in allowed:
                    raise DataError(
                        f"{source_path}: sessions[{s.index}].{split}: {ref} comes from dataset {d!r}, "
                        f"not one of the session's sources {sorted(allowed)}; use a manifest of this protocol"
                    )
                if rid not in sources[d].records:
                    raise DataError(
                        f"{source_path}: sessions[{s.index}].{split}: sample {rid!r} is not in dataset "
                        f"{d} at {sources[d].layout.root}; point --root {sources[d].spec.root} at the "
                        "copy the manifest was made on"
                    )
                if split == "unlabelled" and d in lenders and rid in sources[d].test_pool:
                    raise DataError(
                        f"{source_path}: sessions[{s.index}].unlabelled: {ref} is borrowed from dataset {d}'s test "
                        "pool; borrowed samples come from its training pool and label-free records"
                    )
                if split != "test" and ref in test_ids:
                    raise DataError(
                        f"{source_path}: sessions[{s.index}].{split}: {ref} is also a test sample; "
                        "the manifest mixes training and test data"
                    )
                if split == "validation" and ref in set(splits["train"] or ()) | set(splits["unlabelled"] or ()):
                    raise DataError(
                        f"{source_path}: sessions[{s.index}].validation: {ref} is also a training sample of the "
                        "session; the manifest mixes training and validation data"
                    )
        plans.append(
            SessionPlan(
                s.index,
                s.name,
                list(entry["train"]),
                list(entry["test"]),
                list(entry["unlabelled"]) if entry.get("unlabelled") is not None else None,
                validation=list(entry["validation"]) if entry.get("validation") is not None else None,
            )
        )
    return plans
