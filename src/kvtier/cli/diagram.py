"""Draw the lifecycles of the spec with ``transitions``' GraphMachine.

Layout for reading at page width: top to bottom, the transitions between the same two
states merged into one edge with one line per event (e.g. the five events that end an
``aborting`` request), guards on their own lines (conjunctions broken over lines), and
one labelled edge from a junction point where three or more states share an edge into one
state (``abort [!settled]`` into ``aborting``).

Text formats (``dot``, ``mermaid``) need only the Python ``graphviz`` package; ``svg``
and ``png`` also need the Graphviz ``dot`` binary (``apt-get install graphviz``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from kvtier.fsm.lifecycle.spec import INTERNAL, LifecycleSpec, load_spec

__all__ = ["FORMATS", "TEXT_FORMATS", "render", "write_diagrams", "check_diagrams", "DiagramError"]

FORMATS = ("dot", "mermaid", "svg", "png")
TEXT_FORMATS = ("dot", "mermaid")
_SUFFIX = {"dot": ".dot", "mermaid": ".mmd", "svg": ".svg", "png": ".png"}


class DiagramError(RuntimeError):
    """Rendering failed (e.g. the Graphviz ``dot`` binary is missing)."""


def _graph(spec: LifecycleSpec, engine: Literal["graphviz", "mermaid"]) -> Any:
    """The lifecycle drawn by a GraphMachine: a ``graphviz.Digraph`` for the ``graphviz``
    engine, transitions' mermaid graph (``draw(None)`` gives the text) for ``mermaid``."""
    from transitions.extensions.diagrams import GraphMachine

    machine = GraphMachine(
        states=list(spec.state_names), initial=spec.initial, auto_transitions=False,
        show_conditions=True, graph_engine=engine, title=f"kvtier {spec.title} lifecycle",
    )
    for t in spec.transitions:
        machine.add_transition(
            t.event, t.source, t.source if t.dest == INTERNAL else t.dest,
            conditions=[g.name for g in t.guards if not g.negated],
            unless=[g.name for g in t.guards if g.negated],
        )
    # The machine is its own model; transitions adds ``get_graph`` to it at run time.
    graph = getattr(machine, "get_graph")()
    if engine == "graphviz":
        _page_width_layout(graph)
    else:
        graph = _MermaidTopDown(graph)
    return graph


_EDGE = re.compile(r'^\t(\w+) -> (\w+) \[label=(?:"(.*)"|(\w+))\]$')


#: edges with the same label into the same state from at least this many states meet at
#: a junction point first, labelled once (e.g. ``abort [!settled]`` into ``aborting``)
_JOIN_FROM = 3


def _page_width_layout(graph: Any) -> None:
    """Top to bottom, one edge per (source, dest) pair with one label line per event,
    guards on their own lines (``&``-joined ones wrapped), and the same labelled edge
    from many states into one drawn once from a junction point, so the drawing reads at
    README width (about 1,000 pixels)."""
    graph.graph_attr.update(rankdir="TB", nodesep="0.1", ranksep="0.45", fontsize="13", newrank="true")
    graph.edge_attr.update(fontsize="10")
    merged: dict[tuple[str, str], list[str]] = {}
    nodes: list[str] = []
    for line in graph.body:
        m = _EDGE.match(line.rstrip("\n"))
        if m is None:
            nodes.append(line)
            continue
        key = (m.group(1), m.group(2))
        merged.setdefault(key, []).extend((m.group(3) or m.group(4)).split(" | "))
    labels = {key: _label(parts) for key, parts in merged.items()}
    sources: dict[tuple[str, str], list[str]] = {}  # (dest, label) -> other states with that edge
    for (src, dst), label in labels.items():
        if src != dst:
            sources.setdefault((dst, label), []).append(src)
    edges: list[str] = []
    joined: dict[tuple[str, str], str] = {}
    for (src, dst), label in labels.items():
        srcs = sources.get((dst, label), [])
        if src == dst or len(srcs) < _JOIN_FROM:
            edges.append(f'\t{src} -> {dst} [label="{label}"]\n')
            continue
        if (dst, label) not in joined:
            point = joined[(dst, label)] = f"_join{len(joined) + 1}_{dst}"
            nodes.append(f'\t{point} [label="" shape=point width=0.06]\n')
            edges.append(f'\t{point} -> {dst} [label="{label}"]\n')
        edges.append(f"\t{src} -> {joined[(dst, label)]} [arrowhead=none]\n")
    graph.body[:] = nodes + edges


def _label(parts: list[str]) -> str:
    """One line per event, its guards on the next line; a guard shared by every event
    once, on its own line; long guard conjunctions broken after each ``&`` (dot's ``\\l``:
    left-aligned lines)."""
    split = [p.split(" [", 1) for p in parts]
    guards = {p[1] if len(p) > 1 else "" for p in split}
    if len(parts) > 1 and len(guards) == 1 and "" not in guards:
        lines = [p[0] for p in split] + ["[" + guards.pop()]
    else:
        lines = [p[0] + ("\\l  [" + p[1] if len(p) > 1 else "") for p in split]
    return "".join(line.replace(" & ", " &\\l   ") + "\\l" for line in lines)


class _MermaidTopDown:
    """transitions' mermaid graph drawn top to bottom (``direction TB``)."""

    def __init__(self, graph: Any) -> None:
        self._graph = graph

    def draw(self, filename: None) -> str:
        text: str = self._graph.draw(filename)
        return text.replace("  direction LR\n", "  direction TB\n", 1)


def render(lifecycle: str, fmt: str) -> bytes:
    """One lifecycle (``"node"``, ``"request"``, ``"l3"`` or ``"transfer"``) as ``fmt`` (one of :data:`FORMATS`).

    Returns:
        The file content (UTF-8 text for ``dot``/``mermaid``).

    Raises:
        ValueError: unknown lifecycle or format.
        DiagramError: ``svg``/``png`` without the Graphviz ``dot`` binary.
    """
    spec = load_spec()
    specs = {s.name: s for s in spec.lifecycles}
    if lifecycle not in specs:
        raise ValueError(f"unknown lifecycle {lifecycle!r}; expected one of {sorted(specs)}")
    if fmt not in FORMATS:
        raise ValueError(f"unknown diagram format {fmt!r}; expected one of {FORMATS}")
    if fmt == "mermaid":
        text: str = _graph(specs[lifecycle], "mermaid").draw(None)
        return (text.rstrip("\n") + "\n").encode()
    graph = _graph(specs[lifecycle], "graphviz")
    if fmt == "dot":
        return (str(graph.source).rstrip("\n") + "\n").encode()
    import graphviz  # type: ignore[import-untyped,unused-ignore]  # (no py.typed up to 0.21)

    try:
        data: bytes = graph.pipe(format=fmt)
    except graphviz.ExecutableNotFound as exc:
        raise DiagramError(
            f"rendering {fmt} needs the Graphviz 'dot' binary, which is not installed "
            "(Debian/Ubuntu: apt-get install graphviz; macOS: brew install graphviz); "
            "the text formats dot and mermaid work without it"
        ) from exc
    return data


def _path(out_dir: Path, lifecycle: str, fmt: str) -> Path:
    return out_dir / f"{lifecycle}{_SUFFIX[fmt]}"


#: The lifecycles drawn, by their spec table names (one file per lifecycle and format).
LIFECYCLES = ("node", "request", "l3", "transfer")


def write_diagrams(out_dir: Path, formats: tuple[str, ...]) -> list[Path]:
    """Write every lifecycle in every format to ``out_dir``; returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for lc in LIFECYCLES:
        for fmt in formats:
            path = _path(out_dir, lc, fmt)
            path.write_bytes(render(lc, fmt))
            written.append(path)
    return written


def check_diagrams(out_dir: Path) -> list[str]:
    """Compare the committed text diagrams with what the spec generates now.

    Returns:
        One line per stale or missing file (empty when everything is current).
    """
    problems = []
    for lc in LIFECYCLES:
        for fmt in TEXT_FORMATS:
            path = _path(out_dir, lc, fmt)
            if not path.exists():
                problems.append(f"{path}: missing (run: kvtier diagram --out {out_dir})")
            elif path.read_bytes() != render(lc, fmt):
                problems.append(f"{path}: differs from the spec (run: kvtier diagram --out {out_dir})")
    return problems
