"""mkdocs hook: tables generated from jascl's registries, so the documentation cannot drift from the code.

A page writes a marker; the hook replaces it when the site is built:

- ``<!-- generated:methods -->``: every registered method (name, options block, paper, description);
- ``<!-- generated:events -->``: the loop's events in firing order;
- ``<!-- generated:defaults -->``: the loop's default plugins and what each does;
- ``<!-- generated:paper-tables -->``: the paper's tables shipped as data (``jascl reproduce --list``);
- ``<!-- generated:backbones -->`` and ``<!-- generated:protocols -->``: the other registries.
"""

from __future__ import annotations

import inspect


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _methods() -> str:
    from jascl.methods import METHODS

    rows = ["| method | options | paper | description |", "|---|---|---|---|"]
    for name in METHODS.list():
        info = METHODS.summary(name)
        block = f"`method_args.{info.options_key}`" if info.options else "—"
        rows.append(f"| `{name}` | {block} | {_cell(info.paper) or '—'} | {_cell(info.doc)} |")
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


GENERATORS = {"paper-tables": _paper_tables, "methods": _methods, "events": _events, "defaults": _defaults, "backbones": _backbones,
              "protocols": _protocols}


def on_page_markdown(markdown: str, **kwargs) -> str:
    for key, make in GENERATORS.items():
        marker = f"<!-- generated:{key} -->"
        if marker in markdown:
            markdown = markdown.replace(marker, make())
    return markdown
