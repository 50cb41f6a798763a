#!/usr/bin/env python3
"""Fails when the crate's modules import each other in a cycle, or when a top-level module
uses one of a higher layer than its own (docs/architecture.md, "Layers"; LAYERS below).

A reference from module A to module B (`use crate::b::...`, `crate::b::x(...)`, `super::...`)
is an edge between the two children of their lowest common ancestor that contain A and B:
`crate::config` using `crate::exec::local::X` is the edge config -> exec. References between a
module and its own ancestors or descendants (a parent re-exporting its children, a child using
its parent's trait) are containment, not layering, and are ignored. Test modules
(`#[cfg(test)]`) are ignored: tests may reach anywhere.

Every top-level module must have a layer in LAYERS (a new module fails the check until it is
placed there and in docs/architecture.md's diagram). Edges within one layer are allowed (the
cycle check still holds them).

Usage: module-cycles.py [--graph] [SRC_DIR]   (default: src). Exit 1 and the cycles on
stderr, if any. --graph also prints the edges between the crate's top-level modules (the
diagram of docs/architecture.md).
"""

import os
import re
import sys
from collections import defaultdict

# The layers of docs/architecture.md, top (binaries' logic) to bottom; a module may use its
# own layer and those below.
LAYERS = [
    ("binaries' logic", ["cli"]),
    ("fronts", ["server", "mcp", "config"]),
    ("the one entry point", ["runner"]),
    ("services", ["auth", "audit", "redact", "result", "rate_limit", "session", "peers"]),
    ("execution", ["exec"]),
    ("domain", ["policy", "metrics", "capabilities", "templates", "workspace", "exit"]),
    ("bottom", ["contract", "limits", "caller", "leftovers"]),
]
RANK = {m: len(LAYERS) - i for i, (_, ms) in enumerate(LAYERS) for m in ms}
LAYER_OF = {m: name for name, ms in LAYERS for m in ms}

ARGS = [a for a in sys.argv[1:] if a != "--graph"]
GRAPH = "--graph" in sys.argv[1:]
SRC = ARGS[0] if ARGS else "src"
ROOTS = {"lib.rs"}  # the library crate; binaries only use it from outside


def module_path(rel):
    """src-relative file path -> module path tuple (crate root = ())."""
    parts = rel[:-3].split(os.sep)
    if parts[-1] in ("mod", "lib"):
        parts = parts[:-1]
    return tuple(parts)


def strip_tests(text):
    """Drops `#[cfg(test)]` items (a `mod tests { ... }` block or a single item)."""
    out, i = [], 0
    for m in re.finditer(r"#\[cfg\(test\)\]", text):
        if m.start() < i:
            continue
        out.append(text[i : m.start()])
        j = m.end()
        # The item ends at its matching closing brace, or at the first `;` before any brace.
        depth, k = 0, j
        while k < len(text):
            c = text[k]
            if c == ";" and depth == 0:
                k += 1
                break
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
                if depth == 0:
                    k += 1
                    break
            k += 1
        i = k
    out.append(text[i:])
    return "".join(out)


def strip_comments(text):
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


files = {}
for dirpath, _, names in os.walk(SRC):
    for n in names:
        if not n.endswith(".rs"):
            continue
        rel = os.path.relpath(os.path.join(dirpath, n), SRC)
        if rel.startswith("bin" + os.sep):
            continue
        files[module_path(rel)] = os.path.join(dirpath, n)
modules = set(files)


def resolve(path):
    """The longest known module prefix of a module path."""
    while path and path not in modules:
        path = path[:-1]
    return path


# Modules declared `#[cfg(test)] mod x;` (tests in a file of their own) are tests too.
test_only = set()
for mod, fname in files.items():
    raw = open(fname, encoding="utf-8").read()
    for m in re.finditer(r"#\[cfg\(test\)\]\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*;", raw):
        test_only.add(mod + (m.group(1),))
files = {
    m: f for m, f in files.items() if not any(m[: len(t)] == t for t in test_only)
}

edges = defaultdict(set)  # (parent, child_a) -> set(child_b), within one parent
where = {}
for mod, fname in files.items():
    text = strip_comments(strip_tests(open(fname, encoding="utf-8").read()))
    targets = []
    for m in re.finditer(r"\bcrate((?:::\w+)+)", text):
        targets.append(tuple(m.group(1).split("::")[1:]))
    for m in re.finditer(r"\b((?:super::)+)(\w+(?:::\w+)*)", text):
        ups = m.group(1).count("super::")
        # `super` of a file module is its parent module.
        base = mod[: len(mod) - ups] if len(mod) >= ups else ()
        targets.append(base + tuple(m.group(2).split("::")))
    # `use crate::{a::X, b::Y}` groups
    for m in re.finditer(r"\buse\s+crate::\{([^;]*)\};", text, flags=re.S):
        for item in re.findall(r"(\w+)(?:::|\s*[,}]|$)", m.group(1)):
            targets.append((item,))
    for t in targets:
        tgt = resolve(t)
        if tgt == mod or not tgt and not t:
            continue
        # Containment (ancestor or descendant): not an edge.
        if mod[: len(tgt)] == tgt or tgt[: len(mod)] == mod:
            continue
        k = 0
        while k < min(len(mod), len(tgt)) and mod[k] == tgt[k]:
            k += 1
        parent, a, b = mod[:k], mod[k], tgt[k]
        edges[(parent, a)].add(b)
        where.setdefault((parent, a, b), "::".join(("crate",) + mod))

cycles = []
parents = {p for (p, _) in edges}
for parent in sorted(parents):
    graph = {a: bs for (p, a), bs in edges.items() if p == parent}
    # Tarjan's strongly connected components.
    index, low, stack, on, comps = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    for comp in comps:
        name = "::".join(("crate",) + parent)
        lines = [f"import cycle among the children of {name}: {', '.join(comp)}"]
        for a in comp:
            for b in sorted(graph.get(a, ())):
                if b in comp:
                    lines.append(f"  {a} -> {b} (in {where[(parent, a, b)]})")
        cycles.append("\n".join(lines))

if GRAPH:
    for (parent, a), bs in sorted(edges.items()):
        if parent == ():
            print(f"{a} -> {' '.join(sorted(bs))}")

top = sorted({m[0] for m in modules if m})
for m in top:
    if m not in RANK:
        cycles.append(
            f"top-level module {m} has no layer: add it to LAYERS in .ci/module-cycles.py "
            "and to the diagram of docs/architecture.md"
        )
for (parent, a), bs in sorted(edges.items()):
    if parent != () or a not in RANK:
        continue
    for b in sorted(bs):
        if b in RANK and RANK[b] > RANK[a]:
            cycles.append(
                f"upward edge: {a} ({LAYER_OF[a]}) uses {b} ({LAYER_OF[b]}), "
                f"in {where[(parent, a, b)]}"
            )

if cycles:
    print("\n".join(cycles), file=sys.stderr)
    sys.exit(1)
print(f"no import cycles among {len(modules)} modules, no upward edge between {len(top)} top-level modules")
