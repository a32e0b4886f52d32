"""mkdocs hook: tables generated from jascl's registries, so the documentation cannot drift from the code.

A page writes a marker; the hook replaces it when the site is built:

- ``<!-- generated:methods -->``: every registered method (name, options block, paper, description, fidelity);
- ``<!-- generated:events -->``: the loop's events in firing order;
- ``<!-- generated:defaults -->``: the loop's default plugins and what each does;
- ``<!-- generated:paper-tables -->``: the paper's tables shipped as data (``jascl reproduce --list``);
- ``<!-- generated:backbones -->`` and ``<!-- generated:protocols -->``: the other registries;
- ``<!-- generated:preset-authors -->``: the ``authors`` configuration preset, item by item;
- ``<!-- generated:protocol-reference -->``: every key of a protocol file (``jascl.protocols.reference``), the
  ``preprocess`` keys (``jascl.data.preprocess_reference``) and the run-configuration keys of ``training``;
- ``<!-- generated:datasets -->``, ``<!-- generated:dataset-archives -->``, ``<!-- generated:dataset-manual -->``, ``<!-- generated:dataset-verification -->`` and
  ``<!-- generated:weights -->``: the dataset catalogue and the released checkpoints (``jascl data list``,
  ``jascl weights list``).
"""

from __future__ import annotations

import inspect


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _methods() -> str:
    from jascl.methods import METHODS
    from jascl.methods.fidelity import Fidelity

    rows = ["| method | options | paper | description | fidelity |", "|---|---|---|---|---|"]
    for name in METHODS.list():
        info = METHODS.summary(name)
        block = f"`method_args.{info.options_key}`" if info.options else "—"
        fid = Fidelity(info.fidelity, info.flags)
        rows.append(
            f"| `{name}` | {block} | {_cell(info.paper) or '—'} | {_cell(info.doc)} | "
            f"[{fid.mark}] {_cell(fid.text())} |"
        )
    return "\n".join(rows)


def _events() -> str:
    from jascl.engine.plugin import EVENTS

    return " → ".join(f"`{e}`" for e in EVENTS if e != "session_restored") + \
        " (and `session_restored` for a session reused instead of trained)"


def _defaults() -> str:
    from jascl.engine import defaults
    from jascl.engine.plugin import EVENTS, Plugin

    rows = ["| default plugin | events | what it does |", "|---|---|---|"]
    for cls in (defaults.ClassifierGrowth, defaults.SupervisedLoss, defaults.ModelSelection, defaults.StorePrototypes,
                defaults.Evaluation, defaults.SessionCheckpoint):
        events = [e for e in EVENTS if getattr(cls, e) is not getattr(Plugin, e)]
        doc = inspect.getdoc(cls).split("\n\n")[0]
        rows.append(f"| `{cls.name}` | {', '.join(f'`{e}`' for e in events)} | {_cell(doc)} |")
    return "\n".join(rows)


def _backbones() -> str:
    from jascl.networks import BACKBONES

    return "\n".join(["| backbone | description |", "|---|---|"]
                     + [f"| `{n}` | {_cell(BACKBONES.describe(n))} |" for n in BACKBONES.list()])


def _protocols() -> str:
    from jascl.protocols import builtin_protocols, get_protocol

    rows = ["| protocol | dims | sessions | classes | description |", "|---|---|---|---|---|"]
    for name, path in builtin_protocols().items():
        p = get_protocol(path)
        rows.append(f"| `{name}` | {p.spatial_dims}D | {len(p.sessions)} | {len(p.classes) - 1} | "
                    f"{_cell(p.description)} |")
    return "\n".join(rows)


def _paper_tables() -> str:
    from jascl.methods import METHODS
    from jascl.paper import paper_tables

    rows = ["| table | kind | protocol | stand-in | rows × columns | methods registered | caption |",
            "|---|---|---|---|---|---|---|"]
    registered = set(METHODS.list())
    for t in paper_tables().values():
        methods = sorted({c.method for c in t.cells() if c.method})
        have = sum(m in registered for m in methods)
        rows.append(f"| `{t.label}` | {t.kind} | {t.protocol or '—'} | {t.stand_in or '—'} | "
                    f"{len(t.rows)} × {len(t.columns)} | {have} of {len(methods)} | {_cell(t.caption)} |")
    return "\n".join(rows)


def _preset_authors() -> str:
    from jascl.engine.config_presets import AUTHORS

    rows = ["| item | keys (`--preset authors` sets) | jascl default | the authors' code | why the default |",
            "|---|---|---|---|---|"]
    for item in AUTHORS:
        keys = "<br>".join(f"`{k}={v}`" for k, v in item.values.items()) or "— (the protocol's)"
        rows.append(f"| {_cell(item.item)} | {keys} | {_cell(item.default)} | {_cell(item.preset)} | {_cell(item.why)} |")
    return "\n".join(rows)


def _datasets() -> str:
    from jascl.data.catalogue import CATALOGUE, protocol_roots

    users = protocol_roots()
    rows = ["| root name | dataset | layout | protocols | licence | size | how to get it | checksum |",
            "|---|---|---|---|---|---|---|---|"]
    for name in sorted(CATALOGUE, key=lambda n: (n not in users, n)):
        e = CATALOGUE[name]
        rows.append(f"| `{name}` | {_cell(e.title)} | `{e.layout}` | {', '.join(sorted(users.get(name, {}))) or '—'} | "
                    f"{_cell(e.licence)} | {_cell(e.size) or 'not recorded'} | {_cell(e.how)} | {_cell(e.verification)} |")
    return "\n".join(rows)


def _dataset_archives() -> str:
    from jascl.data.catalogue import CATALOGUE

    rows = ["| root name | file | URL | checksum | where the checksum comes from |", "|---|---|---|---|---|"]
    for e in CATALOGUE.values():
        for a in e.resolved_archives() if e.downloadable else ():
            check = f"{a.checksum_kind} `{a.sha256 or a.md5}`" if a.verified else "**none recorded** (`--no-verify`)"
            rows.append(f"| `{e.name}` | `{a.filename}` | <{a.url}> | {check} | {_cell(a.checksum_note) or '—'} |")
    return "\n".join(rows)


def _dataset_verification() -> str:
    from jascl.data.catalogue import CATALOGUE
    from jascl.download import PUBLISHED, RECORDED

    groups = {PUBLISHED: [], RECORDED: [], "": []}
    for e in CATALOGUE.values():
        if e.downloadable:
            sources = {a.checksum_source if a.verified else "" for a in e.resolved_archives()}
            groups["" if "" in sources else sorted(sources)[0]].append(f"`{e.name}`")
    return "\n".join([
        f"- **Verified against a checksum its host publishes**: {', '.join(groups[PUBLISHED]) or 'none'}.",
        f"- **Verified against a checksum recorded by others** (the host publishes none; a file the host changed "
        f"would fail although genuine, and the error names both digests): {', '.join(groups[RECORDED]) or 'none'}.",
        f"- **Not verified** (no checksum recorded: the download prints the SHA-256 it got and needs `--no-verify`): "
        f"{', '.join(groups['']) or 'none'}.",
    ])


def _dataset_manual() -> str:
    from jascl.data.catalogue import CATALOGUE

    rows = ["| root name | access | register | fetch | unpack (the root) |", "|---|---|---|---|---|"]
    for e in CATALOGUE.values():
        if not e.downloadable:
            rows.append(f"| `{e.name}` | {_cell(e.access)} | {_cell(e.register)} | {_cell(e.fetch)} | {_cell(e.unpack)} |")
    return "\n".join(rows)


def _weights() -> str:
    from jascl.networks.released import WEIGHTS

    rows = ["| name | model | file | checksum | licence | use |", "|---|---|---|---|---|---|"]
    for w in WEIGHTS.values():
        a = w.archive
        check = f"{a.checksum_kind} `{a.sha256 or a.md5}` ({_cell(a.checksum_note)})" if a.verified else \
            "**none recorded** (`--no-verify`)"
        rows.append(f"| `{w.name}` | {_cell(w.title)} | <{a.url}> | {check} | {_cell(w.licence)} | "
                    f"`{_cell(w.use.format(path='FILE'))}` |")
    return "\n".join(rows)


def _rst(text: str) -> str:
    """Docstring markup as markdown: ``x`` -> `x`, :role:`x` -> `x`."""
    import re

    return re.sub(r":\w+:`~?([^`]+)`", r"`\1`", str(text)).replace("``", "`")


def _protocol_reference() -> str:
    import dataclasses

    from jascl.data.preprocess_reference import IMAGE_KEYS, VOLUME_KEYS
    from jascl.engine.config import RunConfig
    from jascl.protocols.reference import attribute_docs, reference_sections

    out = []
    for section, rows in reference_sections():
        out += [f"## {section.title}" + (f" (`{section.path}`)" if section.path else ""), ""]
        if section.intro:
            out += [section.intro, ""]
        out += ["| key | type | default | allowed | what it does | example |", "|---|---|---|---|---|---|"]
        for r in rows:
            out.append(f"| `{r['key']}` | {_cell(r['type'])} | {_cell(r['default'])} | {_cell(r['allowed']) or '—'} | "
                       f"{_cell(_rst(r['doc']))} | `{_cell(r['example'])}` |")
        out.append("")
    for title, keys in (("volumes (`spatial_dims: 3`)", VOLUME_KEYS), ("images (`spatial_dims: 2`)", IMAGE_KEYS)):
        out += [f"## Preprocessing of {title} (`datasets.<name>.preprocess`)", "",
                "| key | type | default | allowed | what it does | example |", "|---|---|---|---|---|---|"]
        out += [f"| `{k}` | {_cell(t)} | {_cell(d)} | {_cell(a) or '—'} | {_cell(w)} | `{_cell(e)}` |"
                for k, t, d, a, w, e in keys]
        out.append("")
    docs = attribute_docs(RunConfig)
    out += ["## Run-configuration keys (`training`)", "",
            "The same keys as a `--config` file and `--set KEY=VALUE`; the protocol's `training` section gives "
            "its defaults, a config file and `--set` override them (in that order).", "",
            "| key | default | what it does |", "|---|---|---|"]
    for f in dataclasses.fields(RunConfig):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        shown = "null" if default is None else str(default).lower() if isinstance(default, bool) else default
        out.append(f"| `{f.name}` | `{_cell(shown)}` | {_cell(_rst(docs.get(f.name, '')))} |")
    return "\n".join(out)


GENERATORS = {"protocol-reference": _protocol_reference, "preset-authors": _preset_authors, "paper-tables": _paper_tables, "methods": _methods, "events": _events, "defaults": _defaults, "backbones": _backbones,
              "protocols": _protocols, "datasets": _datasets, "dataset-archives": _dataset_archives,
              "dataset-manual": _dataset_manual,
              "dataset-verification": _dataset_verification, "weights": _weights}


def on_page_markdown(markdown: str, **kwargs) -> str:
    for key, make in GENERATORS.items():
        marker = f"<!-- generated:{key} -->"
        if marker in markdown:
            markdown = markdown.replace(marker, make())
    return markdown
