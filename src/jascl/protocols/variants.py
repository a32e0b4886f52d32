"""Protocol variants a paper table asks for, built from a validated protocol and checked by the same rules.

:func:`with_unlabelled_extra` resolves a table's ``unlabelled_extra: N`` (table ``tab:unlabeled_effect``:
"additional unlabeled CT data (TotalSegmentator, AMOS, BCV, MOTS)" in the BraTS session of Med
Semi-Supervised-JASCL) into the session key ``unlabelled_sources``.
"""

from __future__ import annotations

import dataclasses

from jascl.errors import ConfigError
from jascl.protocols.parse import check_unlabelled_sources
from jascl.protocols.reader import _Reader
from jascl.protocols.schema import Protocol, UnlabelledSourceSpec


def renamed_variant(protocol: Protocol, name: str, **changes) -> Protocol:
    """``protocol`` with ``changes`` (dataclass fields), named ``name``. If the variant's session 0 is the same
    (its spec, and everything else but the name, the later sessions and the unlabelled pools' noise, which session 0
    does not have), it records ``protocol`` and what ``protocol`` kept session 0 of in ``session0_of``: a base model
    trained for any of them is its base too."""
    variant = dataclasses.replace(protocol, name=name, **changes)

    def session0(p: Protocol) -> Protocol:
        return dataclasses.replace(p, name="", sessions=p.sessions[:1], unlabelled_noise="none", session0_of=())

    if session0(variant) != session0(protocol):
        return dataclasses.replace(variant, session0_of=())
    return dataclasses.replace(variant, session0_of=tuple(dict.fromkeys((protocol.name, *protocol.session0_of))))


def _even(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` near-equal counts, the remainder to the first ones (42 / 4 -> 11, 11, 10, 10)."""
    base, rest = divmod(total, parts)
    return [base + (1 if i < rest else 0) for i in range(parts)]


def earlier_sources(protocol: Protocol, session: int) -> list[list[str]]:
    """Per earlier session (0 .. ``session`` - 1) that has any, the sources it can lend unlabelled data from.

    Protocols on datasets: the dataset entries the session reads (``sources``); synthetic protocols: its
    domains. A source already listed for an earlier session, or one the target session uses itself, is
    left out (so each source appears once, under the first session that used it).
    """
    target = protocol.sessions[session]
    own = {s.dataset for s in target.sources} if protocol.uses_datasets else set(target.domains)
    seen: set[str] = set()
    out: list[list[str]] = []
    for s in protocol.sessions[:session]:
        names = [src.dataset for src in s.sources] if protocol.uses_datasets else list(s.domains)
        group = [n for n in dict.fromkeys(names) if n not in seen and n not in own]
        seen.update(group)
        if group:
            out.append(group)
    return out


def with_unlabelled_extra(protocol: Protocol, session: int, count: int) -> Protocol:
    """The protocol with ``count`` unlabelled samples borrowed by session ``session`` from the earlier sessions.

    The count is split evenly over the earlier sessions (remainder to the first), then evenly over each
    session's sources (:func:`earlier_sources`): in ``med-ss``, session 4 (BraTS) with 42 borrows 11 from
    TotalSegmentator, 11 from AMOS, 10 from BCV and 10 from MOTS (4 hepatic vessel, 3 colon, 3 lung); on
    ``synthetic-2d-ss``, session 3 (xray) with 42 borrows 14 each from the ct, mri and us domains. The
    entries are appended to the session's ``unlabelled_sources`` (a source already there gets the sum),
    checked by the protocol's rules, and the protocol is renamed ``<name>-s<session>extra<count>`` (its
    data cache and run folders are then its own).

    Raises:
        ConfigError: no such session, a negative count, or a session with no earlier source (the base).
    """
    where = f"{protocol.path}: sessions[{session}]"
    if not 0 <= session < len(protocol.sessions):
        raise ConfigError(
            f"{where}: unlabelled_extra: protocol {protocol.name} has sessions 0-{len(protocol.sessions) - 1}"
        )
    if count < 0:
        raise ConfigError(f"{where}: unlabelled_extra must be a non-negative number of samples (got {count})")
    groups = earlier_sources(protocol, session)
    if not groups:
        raise ConfigError(
            f"{where}: unlabelled_extra: no earlier session has a source to borrow from; choose an incremental session"
        )
    kind = "dataset" if protocol.uses_datasets else "domain"
    borrowed: dict[str, int] = {s.name: s.count for s in protocol.sessions[session].unlabelled_sources}
    for group, share in zip(groups, _even(count, len(groups))):
        for name, n in zip(group, _even(share, len(group))):
            if n:
                borrowed[name] = borrowed.get(name, 0) + n
    specs = tuple(UnlabelledSourceSpec(n, **{kind: name}) for name, n in borrowed.items())
    sessions = list(protocol.sessions)
    sessions[session] = dataclasses.replace(sessions[session], unlabelled_sources=specs)
    check_unlabelled_sources(_Reader(protocol.path), sessions)
    return renamed_variant(protocol, f"{protocol.name}-s{session}extra{count}", sessions=tuple(sessions))
