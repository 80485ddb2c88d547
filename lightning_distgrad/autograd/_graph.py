"""The local autograd graph of a backward pass: edges, parents and incoming-edge counts."""

from __future__ import annotations

import collections
from typing import Any


def is_leaf_node(node: Any) -> bool:
    return hasattr(node, "variable")


class Graph:
    """Edges, parents and incoming-edge counts of the nodes reachable from ``starts``."""

    def __init__(self, starts: list, recvs: set):
        self.children: dict[Any, list[tuple[Any, int]]] = {}
        self.parents: dict[Any, list[Any]] = collections.defaultdict(list)
        self.remaining: dict[Any, int] = collections.defaultdict(int)
        self.boundary: set = set()
        seen = set(starts)
        queue = list(starts)
        while queue:
            node = queue.pop()
            if node in recvs or is_leaf_node(node):
                self.boundary.add(node)
                self.children[node] = []
                continue
            kids = [(c, nr) for c, nr in node.next_functions if c is not None]
            self.children[node] = kids
            for child, _ in kids:
                self.remaining[child] += 1
                self.parents[child].append(node)
                if child not in seen:
                    seen.add(child)
                    queue.append(child)

    def descendants(self, nodes) -> set:
        out: set = set()
        queue = [c for n in nodes for c, _ in self.children[n]]
        while queue:
            node = queue.pop()
            if node not in out:
                out.add(node)
                queue.extend(c for c, _ in self.children[node])
        return out

    def ancestors_within(self, nodes, within: set) -> set:
        """``nodes``' parents in ``within``, transitively."""
        out: set = set()
        queue = [p for t in nodes for p in self.parents[t] if p in within]
        while queue:
            node = queue.pop()
            if node not in out:
                out.add(node)
                queue.extend(p for p in self.parents[node] if p in within)
        return out
