"""Fail if any modules of the package import each other in a cycle (run by .ci/run).

import-linter's layers contract keeps imports between layers one-way; this check covers the
modules inside a layer too. Imports made only for type checking (``if TYPE_CHECKING:``) are
left out: they never run.
"""

from __future__ import annotations

import sys

import grimp


def cycles(package: str) -> list[list[str]]:
    """Strongly connected groups of more than one module in ``package``'s import graph."""
    graph = grimp.build_graph(package, exclude_type_checking_imports=True)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for other in graph.find_modules_directly_imported_by(module):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in on_stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            group = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                group.append(top)
                if top == module:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph.modules)))
    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return found


if __name__ == "__main__":
    groups = cycles("jascl")
    for group in groups:
        print("import cycle: " + " <-> ".join(group), file=sys.stderr)
    print(f"import cycles: {len(groups)}")
    sys.exit(1 if groups else 0)
