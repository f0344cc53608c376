#!/usr/bin/env python3
"""Fails when the Rust files of a crate import each other in a circle, or
when a file of the api imports a layer above its own.

Each crate under services/ is read as files: every `use` tree and every
inline `crate::…` / `super::…` / `self::…` path is resolved to the deepest
module file it names, giving file -> file edges; a strongly connected
component of more than one file is a circle. Test modules count too.

The api's layers, lowest first: storage (`db`), use-cases (`app`), and the
transports, loops and start-up (`grpc`, `rest`, `portal`, `relay`, `detach`,
`auth`, `openapi`, `config`, `serve`, `lib`, `main`). A layer may import its own and those below, and
the crate's leaf modules (errors, bodies, secrets, the broker, metrics…),
which may import none of the layers; the domain itself is a crate of its
own (`services/domain`), below them all, with no I/O. A wrong-way import
(`db` using `app`, `app` using a transport) fails.
Usage: .ci/import-cycles.py [services-dir]
"""
import os
import re
import sys

ROOT = sys.argv[1] if len(sys.argv) > 1 else "services"


def module_of(src, path):
    rel = os.path.relpath(path, src)[:-3].split(os.sep)
    if rel[-1] in ("lib", "main", "mod"):
        rel = rel[:-1]
    return tuple(rel)


def strip_comments(text):
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    return re.sub(r'"(?:\\.|[^"\\])*"', '""', text)


def expand(tree):
    """Expands a use tree (`a::{b, c::{d, e}}`) into paths."""
    tree = tree.strip()
    depth, start = 0, None
    for i, ch in enumerate(tree):
        if ch == "{":
            if depth == 0:
                start = i
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                prefix = tree[:start].rstrip(":").strip()
                inner, parts, d, last = tree[start + 1 : i], [], 0, 0
                for j, c in enumerate(inner):
                    d += c == "{"
                    d -= c == "}"
                    if c == "," and d == 0:
                        parts.append(inner[last:j])
                        last = j + 1
                parts.append(inner[last:])
                out = []
                for p in parts:
                    if p.strip():
                        out += [(prefix + "::" + q) if prefix else q for q in expand(p)]
                return out
    return [re.sub(r"\s+as\s+\w+$", "", tree)]


def inline_mod_spans(text):
    """Spans of inline `mod name { … }` blocks: inside one, `super` is the file."""
    spans = []
    for m in re.finditer(r"\bmod\s+\w+\s*\{", text):
        depth, i = 0, m.end() - 1
        while i < len(text):
            depth += text[i] == "{"
            depth -= text[i] == "}"
            if depth == 0:
                break
            i += 1
        spans.append((m.start(), i))
    return spans


def resolve(mod, path, modules, inline=0):
    segs = [s for s in path.split("::") if s]
    if not segs:
        return None
    if segs[0] == "crate":
        base, segs = [], segs[1:]
    elif segs[0] in ("super", "self"):
        # Inside inline modules, the first `super`s climb back to the file.
        while inline and segs and segs[0] == "super":
            inline -= 1
            segs = segs[1:]
        if inline and segs and segs[0] == "self":
            return None
        base = list(mod)
        while segs and segs[0] in ("super", "self"):
            if segs[0] == "super" and base:
                base.pop()
            segs = segs[1:]
    else:
        return None
    best = tuple(base) if tuple(base) in modules else None
    cur = list(base)
    for s in segs:
        cur.append(s)
        if tuple(cur) in modules:
            best = tuple(cur)
        else:
            break
    return best


def crate_edges(src):
    files = {}
    for d, _, names in os.walk(src):
        for n in names:
            if n.endswith(".rs"):
                p = os.path.join(d, n)
                files[module_of(src, p)] = p
    edges = {m: set() for m in files}
    for mod, path in files.items():
        text = strip_comments(open(path, encoding="utf-8").read())
        spans = inline_mod_spans(text)
        depth = lambda at: sum(1 for a, b in spans if a < at < b)
        paths = []
        for m in re.finditer(r"\buse\s+([^;]+);", text):
            paths += [(p, depth(m.start())) for p in expand(m.group(1))]
        paths += [(m.group(0), depth(m.start())) for m in re.finditer(r"\b(?:crate|super|self)(?:::\w+)+", text)]
        for p, inline in paths:
            target = resolve(mod, p.replace(" ", ""), files, inline)
            if target is not None and target != mod:
                edges[mod].add(target)
    return files, edges


def circles(edges):
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
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
                out.append(comp)

    sys.setrecursionlimit(10000)
    for v in edges:
        if v not in index:
            visit(v)
    return out


# The api's layers by top-level module; any other module is a leaf (0).
API_LAYERS = {"db": 1, "app": 2}
API_TRANSPORTS = ["grpc", "rest", "portal", "relay", "detach", "auth", "openapi", "config", "serve"]


def layer_of(mod):
    if not mod:
        return 3  # lib.rs
    if mod[0] in API_LAYERS:
        return API_LAYERS[mod[0]]
    if mod[0] in API_TRANSPORTS or mod[0] == "main":
        return 3
    return 0


def wrong_way(files, edges):
    out = []
    for src, targets in edges.items():
        for dst in targets:
            if layer_of(dst) > layer_of(src):
                out.append((files[src], files[dst]))
    return sorted(out)


found = 0
crates = 0
for crate in sorted(os.listdir(ROOT)):
    src = os.path.join(ROOT, crate, "src")
    if not os.path.isdir(src):
        continue
    crates += 1
    files, edges = crate_edges(src)
    for comp in circles(edges):
        found += 1
        print(f"import circle in {crate}: " + " -> ".join(sorted(files[m] for m in comp)))
    if crate == "api":
        for a, b in wrong_way(files, edges):
            found += 1
            print(f"wrong-way import in {crate}: {a} uses {b}, a layer above it")
if found:
    sys.exit(1)
print(f"no import circles in {crates} crates; the api's layers import downwards only")
