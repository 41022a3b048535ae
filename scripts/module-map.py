#!/usr/bin/env python3
"""The module map of one crate: files, lines, who imports whom, import circles, long functions.

    scripts/module-map.py [crates/engine] [--functions N]

A file imports another when its code (not comments, not `#[cfg(test)]` modules) names
`crate::MODULE` (also inside a `use crate::{...}` group) or, in a folder module, `super::`.
Circles are the strongly connected components of that graph with more than one file.
Functions are counted from their `fn` line to the closing brace at the same indentation
(the code is rustfmt-formatted), outside `#[cfg(test)]` modules and `tests/`.
"""
import os
import re
import sys


def strip(text):
    """The code of a file without comments and string literals, and without test modules."""
    out = []
    skip_depth = None
    pending_test = False
    for line in text.splitlines():
        code = re.sub(r'"(\\.|[^"\\])*"', '""', line)
        code = code.split("//", 1)[0]
        stripped = code.strip()
        if skip_depth is not None:
            if line.startswith(" " * skip_depth + "}") and len(line.rstrip()) == skip_depth + 1:
                skip_depth = None
            out.append("")
            continue
        if stripped.startswith("#[cfg(test)]"):
            pending_test = True
            out.append("")
            continue
        if pending_test and re.match(r"(pub(\(crate\))? )?mod \w+ \{", stripped):
            skip_depth = len(line) - len(line.lstrip())
            pending_test = False
            out.append("")
            continue
        if stripped and not stripped.startswith("#"):
            pending_test = False
        out.append(code)
    return out


def module_name(root, path):
    rel = os.path.relpath(path, root)[:-3]
    parts = rel.split(os.sep)
    if parts[-1] == "mod":
        parts = parts[:-1]
    return "::".join(parts)


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    limit = 100
    if "--functions" in sys.argv:
        limit = int(sys.argv[sys.argv.index("--functions") + 1])
        args = [a for a in args if a != str(limit)]
    crate = args[0] if args else "crates/engine"
    root = os.path.join(crate, "src")
    files = {}
    for d, _, names in os.walk(root):
        for n in names:
            if n.endswith(".rs"):
                p = os.path.join(d, n)
                m = module_name(root, p)
                if m in ("lib", "main"):
                    continue
                files[m] = p
    top = {m.split("::")[0] for m in files}
    edges = {m: set() for m in files}
    code_lines = {}
    functions = []
    for m, p in files.items():
        with open(p, encoding="utf-8") as f:
            text = f.read()
        code = strip(text)
        code_lines[m] = (len(text.splitlines()), sum(1 for c in code if c.strip()))
        joined = "\n".join(code)
        targets = set(re.findall(r"crate::(\w+(?:::\w+)*)", joined))
        for group in re.findall(r"crate::\{([^}]*)\}", joined, re.S):
            targets |= {t.strip().split("::")[0] for t in group.split(",") if t.strip()}
        if p.endswith("mod.rs"):
            # a folder module's own `use child::...` names its children
            for child in re.findall(r"^\s*(?:pub(?:\([^)]*\))? )?use (\w+)::", joined, re.M):
                if f"{m}::{child}" in files:
                    edges[m].add(f"{m}::{child}")
        if "::" in m and not p.endswith("mod.rs"):
            # `super::sibling::item` names the sibling's file; `super::item` the parent's
            parent = m.rsplit("::", 1)[0]
            refs = re.findall(r"\bsuper::(\w+)", joined)
            for group in re.findall(r"\bsuper::\{([^}]*)\}", joined, re.S):
                refs += [t.strip().split("::")[0] for t in group.split(",") if t.strip()]
            for r in refs:
                if r == "{":
                    continue
                sibling = f"{parent}::{r}"
                if sibling in files and sibling != m:
                    edges[m].add(sibling)
                elif r not in ("super", "self"):
                    edges[m].add(parent)
        for t in targets:
            parts = t.split("::")
            # the longest module path that names a file
            for k in range(len(parts), 0, -1):
                cand = "::".join(parts[:k])
                if cand in files and cand != m:
                    edges[m].add(cand)
                    break
        # long functions
        lines = text.splitlines()
        for i, line in enumerate(lines):
            if code[i].strip() == "" and line.strip() != "":
                continue  # comment or test module
            mt = re.match(r"^(\s*)(pub(\([^)]*\))? )?(const )?(async )?(unsafe )?fn (\w+)", line)
            if not mt:
                continue
            indent = mt.group(1)
            for j in range(i, len(lines)):
                if lines[j] == indent + "}" or (j == i and line.rstrip().endswith("}")):
                    break
                if j > i and lines[j].rstrip().endswith(";") and lines[j].startswith(indent) and j == i:
                    break
            else:
                continue
            if line.rstrip().endswith(";"):
                continue
            n = j - i + 1
            if n > limit:
                functions.append((n, m, mt.group(7), i + 1))
    # Tarjan
    index, low, on, stack, comps, counter = {}, {}, set(), [], [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
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
            comps.append(comp)

    sys.setrecursionlimit(10000)
    for v in sorted(files):
        if v not in index:
            visit(v)
    print(f"# {crate}: {len(files)} files, {sum(a for a, _ in code_lines.values())} lines")
    print()
    print("| file | lines | code lines | imports |")
    print("|---|---|---|---|")
    for m in sorted(files):
        total, code = code_lines[m]
        print(f"| {os.path.relpath(files[m], root)} | {total} | {code} | {', '.join(sorted(edges[m])) or '-'} |")
    print()
    circles = sorted((sorted(c) for c in comps if len(c) > 1), key=len, reverse=True)
    print(f"import circles: {len(circles)}" + ("" if circles else " (none)"))
    for c in circles:
        print(f"- {len(c)} files: {', '.join(c)}")
    print()
    functions.sort(reverse=True)
    print(f"functions over {limit} lines (outside tests): {len(functions)}")
    for n, m, name, line in functions:
        print(f"- {n} lines: {os.path.relpath(files[m], root)}:{line} {name}")
    _ = top


if __name__ == "__main__":
    main()
