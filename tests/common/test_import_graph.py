"""The product's modules import each other without a cycle, counting imports made only for type checking:
a newcomer can read any module knowing only the ones below it (docs/architecture.md)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import grimp

# The product's packages as import-linter's contracts name them (pyproject.toml), the one list of them.
PRODUCT = tuple(sorted(tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
                       ["tool"]["importlinter"]["root_packages"]))


def import_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(edges[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            module, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(edges.get(child, ()))))
                elif child in on_stack:
                    low[module] = min(low[module], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[module])
            if low[module] == index[module]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == module:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))
    return groups


def test_cycle_finder_finds_a_cycle_through_three_modules():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_cycles(edges) == [["a", "b", "c"]]


def test_no_product_module_imports_one_that_imports_it_back():
    graph = grimp.build_graph(*PRODUCT, cache_dir=None)
    edges = {module: set(graph.find_modules_directly_imported_by(module)) for module in graph.modules}
    assert import_cycles(edges) == []
