"""Write ``src/jascl/registry_index.json``, the index ``jascl methods`` and ``jascl backbones`` list from, out of
the registrations themselves (every method and backbone module imported). Run it after adding a method or a
backbone, or changing how one is registered (name, doc, paper, options, task); ``--check`` only compares
(exit 1 if the index is stale). ``tests/test_registry_index.py`` makes the same comparison, entry by entry.

Usage: ``python tools/registry_index.py [--check]``
"""

from __future__ import annotations

import json
import sys

from jascl.fileio import atomic_write_text
from jascl.methods.registry import METHODS
from jascl.networks.registry import BACKBONES
from jascl.registry import INDEX_FILE, index_of, read_index


def indexed_registries() -> list:
    """Every indexed registry: the methods of each task, the backbones."""
    METHODS.load_all()  # registers every task's implementations, so that each task has its registry
    return [*METHODS.task_registries(), BACKBONES]


def render(index: dict) -> str:
    """The index as the file holds it: sorted keys, one record per line block, a final newline."""
    return json.dumps(index, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def main(argv: list[str]) -> int:
    index = index_of(indexed_registries())
    if "--check" in argv:
        stale = index != read_index(INDEX_FILE)
        print(f"{INDEX_FILE}: {'stale; run python tools/registry_index.py' if stale else 'up to date'}")
        return int(stale)
    atomic_write_text(INDEX_FILE, render(index))
    print(f"wrote {INDEX_FILE}: {', '.join(f'{len(v)} {k}' for k, v in index.items())}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
