"""The protocol as a run resolved it, as JSON (a run folder's ``protocol-resolved.json``) and back.

The resolved file holds the protocol as run (seed override and variants applied), which the
copied ``protocol.yaml`` does not; reports rebuild the protocol from it. JSON has neither
tuples nor non-string object keys, so two things are written with care:

* tuples come back as lists; :func:`protocol_from_json` turns them back into tuples;
* a dataset's label map (``DatasetSpec.labels``) has native ids (``int``) and native label
  *names* (``str``) as keys, which a JSON object would both write as strings (``{"2": 1}``),
  after which native id 2 would be looked up as a label named "2". The map is therefore written
  as a list of ``[native, global]`` pairs, which keeps the key types. Files written before
  (objects with string keys) are still read: there a key of decimal digits is a native id.

Round trip: ``protocol_from_json(protocol_to_json(p)) == p`` (dataclass equality).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from typing import Any

from jascl.protocols.schema import (
    ClassSpec,
    DatasetSpec,
    DomainSpec,
    Protocol,
    SessionSpec,
    SourceSpec,
    SyntheticSpec,
    UnlabelledSourceSpec,
)

__all__ = ["protocol_from_json", "protocol_to_json"]


def protocol_to_json(protocol: Protocol) -> dict[str, Any]:
    """``protocol`` as plain JSON types (what ``protocol-resolved.json`` holds); label maps as ``[native, global]`` pairs."""
    data = dataclasses.asdict(protocol)
    for entry in data.get("datasets", {}).values():
        entry["labels"] = [[native, target] for native, target in entry["labels"].items()]
    return json.loads(json.dumps(data, default=list))


def _label_map(raw: Any) -> dict[int | str, int]:
    """A label map as written by :func:`protocol_to_json` (pairs), or by jascl before (an object, string keys)."""
    if isinstance(raw, Mapping):  # older run folders: JSON made every native id a string
        return {(int(k) if isinstance(k, str) and k.isascii() and k.isdigit() else k): v for k, v in raw.items()}
    return {native: target for native, target in raw}


def _build(cls: type, raw: Mapping[str, Any], nested: Mapping[str, Callable[[Any], Any]] | None = None) -> Any:
    """``cls(**raw)``: keys ``cls`` does not have skipped (a later jascl's), lists made tuples, ``nested`` applied."""
    nested = nested or {}
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        if key not in names:
            continue
        if key in nested and value is not None:
            value = nested[key](value)
        kwargs[key] = tuple(value) if isinstance(value, list) else value
    return cls(**kwargs)


def protocol_from_json(data: Mapping[str, Any]) -> Protocol:
    """Rebuild the :class:`Protocol` that :func:`protocol_to_json` wrote (or an older ``protocol-resolved.json``).

    Keys this version does not know are ignored; keys it added since take their defaults.
    """
    session_nested: dict[str, Callable[[Any], Any]] = {
        "sources": lambda v: [_build(SourceSpec, s) for s in v],
        "unlabelled_sources": lambda v: [_build(UnlabelledSourceSpec, s) for s in v],
    }
    dataset_nested: dict[str, Callable[[Any], Any]] = {"labels": _label_map}
    nested: dict[str, Callable[[Any], Any]] = {
        "classes": lambda v: [_build(ClassSpec, c) for c in v],
        "domains": lambda v: {k: _build(DomainSpec, d) for k, d in v.items()},
        "sessions": lambda v: [_build(SessionSpec, s, session_nested) for s in v],
        "synthetic": lambda v: _build(SyntheticSpec, v),
        "training": dict,
        "datasets": lambda v: {k: _build(DatasetSpec, d, dataset_nested) for k, d in v.items()},
    }
    return _build(Protocol, data, nested)
