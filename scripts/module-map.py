#!/usr/bin/env python3
"""The module map of the workspace's crates, and the check of its walls.

    scripts/module-map.py [CRATE_DIR] [--functions N]    the map of one crate, or of every crate
    scripts/module-map.py --check                         the walls of the whole workspace

The map of a crate: its files, lines, who imports whom, import circles, functions over N lines
(default 100). A file imports another when its code (not comments, not `#[cfg(test)]` modules
or files) names `crate::MODULE` (also inside a `use crate::{...}` group) or, in a folder module,
`super::`. Circles are the strongly connected components of that graph with more than one file.
Functions are counted from their `fn` line to the closing brace at the same indentation (the
code is rustfmt-formatted), outside `#[cfg(test)]` modules and `tests/`.

`--check` fails (exit 1), printing `file:line: what` for each, when in any workspace crate
(crates/*, bench) there is an import circle; a module importing one on a higher layer, or a
crate depending on one on a higher layer (the layers: scripts/layers.txt); a function over
100 lines outside tests (unless in LONG_FUNCTIONS_ALLOWED); `json!` in more than JSON_LIMIT
places in the CLI and the service; a crate's src/ over CRATE_LINES lines or the CLI's over
CLI_LINES; a `fuzz` or `sim` module compiled without a `#[cfg(...)]` (test code in release builds).
"""
import os
import re
import sys

FUNCTION_LINES = 100
JSON_LIMIT = 5  # `json!` in crates/cli + crates/service: reports get `Serialize` types instead
JSON_CRATES = ("crates/cli", "crates/service")
CRATE_LINES = 12_000  # lines of a crate's src/ (tests/ reported, not limited)
CLI_LINES = 3_500
# Functions allowed over FUNCTION_LINES, as "path/from/repo.rs NAME", each with a comment
# saying why it cannot be split. The goal is none.
LONG_FUNCTIONS_ALLOWED = {}

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYERS = os.path.join(ROOT, "scripts", "layers.txt")


def strip(text):
    """The code of a file without comments, string literals and test modules, line for line."""
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


def module_name(src, path):
    parts = os.path.relpath(path, src)[:-3].split(os.sep)
    if parts[-1] == "mod":
        parts = parts[:-1]
    return "::".join(parts)


def line_of(text, pos):
    return text.count("\n", 0, pos) + 1


def group_heads(code, prefix):
    """(first name, position) of each path in the `PREFIX::{...}` groups of the code."""
    out = []
    for mt in re.finditer(rf"\b{prefix}::\{{", code):
        depth, item = 1, ""
        for ch in code[mt.end() :]:
            depth += {"{": 1, "}": -1}.get(ch, 0)
            if depth == 0 or (depth == 1 and ch == ","):
                if item.strip(" \n{"):
                    out.append((item.strip(" \n{").split("::")[0], mt.start()))
                if depth == 0:
                    break
                item = ""
            elif depth == 1:
                item += ch
    return out


def analyse(crate, limit=FUNCTION_LINES):
    """Files, lines, import edges (with the line of the first import), long functions, circles."""
    src = os.path.join(crate, "src")
    files, texts, test_only = {}, {}, set()
    for d, _, names in os.walk(src):
        for n in sorted(names):
            if n.endswith(".rs"):
                p = os.path.join(d, n)
                files[module_name(src, p)] = p
                with open(p, encoding="utf-8") as f:
                    texts[p] = f.read()
    # `#[cfg(test)] mod NAME;` makes NAME's file test code
    for m, p in files.items():
        parent = "" if m in ("lib", "main") else m if p.endswith("mod.rs") else m.rsplit("::", 1)[0] if "::" in m else ""
        for child in re.findall(r"#\[cfg\(test\)\]\s*(?:pub(?:\([^)]*\))? )?mod (\w+);", texts[p]):
            test_only.add(f"{parent}::{child}" if parent else child)
    roots = {m: p for m, p in files.items() if m in ("lib", "main")}
    test_files = {p for m, p in files.items() if m in test_only}
    files = {m: p for m, p in files.items() if m not in roots and m not in test_only}
    edges = {m: {} for m in files}  # module -> {imported module: line}
    lines, functions = {}, []
    for m, p in files.items():
        text = texts[p]
        code = strip(text)
        lines[m] = (len(text.splitlines()), sum(1 for c in code if c.strip()))
        joined = "\n".join(code)

        def add(target, pos):
            if target != m and target not in edges[m]:
                edges[m][target] = line_of(joined, pos)

        refs = [(mt.group(1), mt.start()) for mt in re.finditer(r"crate::(\w+(?:::\w+)*)", joined)]
        refs += group_heads(joined, "crate")
        for t, pos in refs:
            parts = t.split("::")
            for k in range(len(parts), 0, -1):  # the longest module path that names a file
                if "::".join(parts[:k]) in files:
                    add("::".join(parts[:k]), pos)
                    break
        if p.endswith("mod.rs"):
            # a folder module's own `use child::...` names its children
            for mt in re.finditer(r"^\s*(?:pub(?:\([^)]*\))? )?use (\w+)::", joined, re.M):
                if f"{m}::{mt.group(1)}" in files:
                    add(f"{m}::{mt.group(1)}", mt.start())
        if "::" in m and not p.endswith("mod.rs"):
            # `super::sibling::item` names the sibling's file; `super::item` the parent's
            parent = m.rsplit("::", 1)[0]
            refs = [(mt.group(1), mt.start()) for mt in re.finditer(r"\bsuper::(\w+)", joined)]
            refs += group_heads(joined, "super")
            for r, pos in refs:
                if f"{parent}::{r}" in files:
                    add(f"{parent}::{r}", pos)
                elif r not in ("super", "self"):
                    add(parent, pos)
        functions += long_functions(p, text, code, limit)
    stripped = {p: "\n".join(strip(text)) for p, text in texts.items() if p not in test_files}
    for m, p in roots.items():
        functions += long_functions(p, texts[p], strip(texts[p]), limit)
    return {
        "files": files,
        "lines": lines,
        "edges": edges,
        "functions": functions,
        "circles": circles(files, edges),
        "src_lines": sum(len(texts[p].splitlines()) for p in texts),
        "test_lines": count_lines(os.path.join(crate, "tests")),
        "ungated": [(p, n) for p, text in texts.items() for n in ungated_test_modules(text)],
        "json": [(p, line_of(code, mt.start())) for p, code in stripped.items() for mt in re.finditer(r"\bjson!", code)],
    }


def ungated_test_modules(text):
    """Lines declaring a `fuzz` or `sim` module with no `#[cfg(...)]` on it: in release builds."""
    lines = text.splitlines()
    out = []
    for i, line in enumerate(lines):
        if re.match(r"\s*(pub(\([^)]*\))? )?mod (fuzz|sim)\b", line):
            j = i - 1
            while j >= 0 and lines[j].strip().startswith(("#[", "//")):
                j -= 1
            if not any("#[cfg(" in a for a in lines[j + 1 : i]):
                out.append(i + 1)
    return out


def long_functions(path, text, code, limit):
    """(lines, path, name, line) of each function over the limit, outside test code."""
    out = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if not code[i].strip():
            continue  # comment or test module
        mt = re.match(r"^(\s*)(pub(\([^)]*\))? )?(const )?(async )?(unsafe )?fn (\w+)", line)
        if not mt:
            continue
        body = i  # the line that opens the body: none for a declaration or a one-line function
        while body < len(lines) and not lines[body].rstrip().endswith(("{", ";", "}")):
            body += 1
        if body == len(lines) or not lines[body].rstrip().endswith("{"):
            continue
        end = next((j for j in range(body + 1, len(lines)) if lines[j] == mt.group(1) + "}"), None)
        if end is not None and end - i + 1 > limit:
            out.append((end - i + 1, path, mt.group(7), i + 1))
    return out


def circles(files, edges):
    """The strongly connected components (Tarjan) with more than one file."""
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
            comps.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(files):
        if v not in index:
            visit(v)
    return sorted((c for c in comps if len(c) > 1), key=len, reverse=True)


def count_lines(folder):
    n = 0
    for d, _, names in os.walk(folder):
        for name in names:
            if name.endswith(".rs"):
                with open(os.path.join(d, name), encoding="utf-8") as f:
                    n += len(f.read().splitlines())
    return n


def report(crate, limit):
    a = analyse(crate, limit)
    src = os.path.join(crate, "src")
    print(f"# {crate}: {len(a['files'])} files, {a['src_lines']} lines in src/, {a['test_lines']} in tests/")
    print()
    print("| file | lines | code lines | imports |")
    print("|---|---|---|---|")
    for m in sorted(a["files"]):
        total, code = a["lines"][m]
        print(f"| {os.path.relpath(a['files'][m], src)} | {total} | {code} | {', '.join(sorted(a['edges'][m])) or '-'} |")
    print()
    print(f"import circles: {len(a['circles'])}" + ("" if a["circles"] else " (none)"))
    for c in a["circles"]:
        print(f"- {len(c)} files: {', '.join(c)}")
    print()
    functions = sorted(f for f in a["functions"] if f[0] > limit)
    functions.reverse()
    print(f"functions over {limit} lines (outside tests): {len(functions)}")
    for n, path, name, line in functions:
        print(f"- {n} lines: {os.path.relpath(path, src)}:{line} {name}")
    print()


def workspace_crates():
    """The workspace's crates as {name: folder}: crates/NAME, and bench if it is a crate."""
    crates = {}
    for name in sorted(os.listdir(os.path.join(ROOT, "crates"))):
        if os.path.exists(os.path.join(ROOT, "crates", name, "Cargo.toml")):
            crates[name] = os.path.join("crates", name)
    if os.path.exists(os.path.join(ROOT, "bench", "Cargo.toml")):
        crates["bench"] = "bench"
    return crates


def path_dependencies(folder):
    """(folder of the dependency, line) of each `path = ...` in [dependencies] tables."""
    out, section = [], ""
    cargo = os.path.join(folder, "Cargo.toml")
    with open(cargo, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            head = re.match(r"^\s*\[([^\]]+)\]", line)
            if head:
                section = head.group(1).strip()
                continue
            mt = re.search(r'path\s*=\s*"([^"]+)"', line)
            if mt and (section == "dependencies" or re.fullmatch(r"target\..*\.dependencies", section)):
                dep = os.path.normpath(os.path.join(folder, mt.group(1)))
                out.append((dep, f"{cargo}:{n}"))
    return out


def read_layers():
    """{section: {name: row}} from scripts/layers.txt, the top row 0."""
    layers, section = {}, None
    with open(LAYERS, encoding="utf-8") as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line.startswith("["):
                section = layers.setdefault(line.strip("[]"), {})
            elif line:
                section.update({name: len(set(section.values())) for name in line.split()})
    return layers


def check():
    layers = read_layers()
    crate_rank = layers["crates"]
    crates = workspace_crates()
    folder_name = {folder: name for name, folder in crates.items()}
    problems = []
    json_sites = []
    for name, folder in crates.items():
        cargo = os.path.join(folder, "Cargo.toml")
        if name not in crate_rank:
            problems.append(f"{cargo}:1: crate {name} has no layer: add it to [crates] in scripts/layers.txt")
        for dep, where in path_dependencies(folder):
            dep_name = folder_name.get(dep)
            if name in crate_rank and crate_rank.get(dep_name, len(crate_rank)) < crate_rank[name]:
                problems.append(f"{where}: crate {name} depends on {dep_name}, a crate on a higher layer")
        a = analyse(folder)
        src = os.path.join(folder, "src")
        for c in a["circles"]:
            inside = [f"{a['files'][m]}:{a['edges'][m][t]} ({m} -> {t})" for m in c for t in sorted(a["edges"][m]) if t in c]
            problems.append(f"{inside[0].split(' ')[0]}: import circle of {len(c)} files: {', '.join(c)}; its imports: {'; '.join(inside)}")
        module_rank = layers.get(name)
        if module_rank is not None:
            for top in sorted({m.split("::")[0] for m in a["files"]} - set(module_rank)):
                problems.append(f"{src}/{top}: module {top} of crate {name} has no layer: add it to [{name}] in scripts/layers.txt")
            for m in sorted(a["files"]):
                mine = module_rank.get(m.split("::")[0])
                for t, line in sorted(a["edges"][m].items()):
                    theirs = module_rank.get(t.split("::")[0])
                    if mine is not None and theirs is not None and theirs < mine:
                        problems.append(f"{a['files'][m]}:{line}: upward import: {m} imports {t}, a module on a higher layer")
        for n, path, fname, line in sorted(a["functions"], key=lambda f: (f[1], f[3])):
            if f"{path} {fname}" not in LONG_FUNCTIONS_ALLOWED:
                problems.append(f"{path}:{line}: function {fname} is {n} lines (limit {FUNCTION_LINES}; split it)")
        for path, line in a["ungated"]:
            problems.append(f"{path}:{line}: test code in release builds: put it behind a feature (`#[cfg(feature = ...)]`)")
        if a["src_lines"] > CRATE_LINES:
            problems.append(f"{src}: crate {name} has {a['src_lines']} lines in src/ (limit {CRATE_LINES}; {a['test_lines']} in tests/)")
        if folder == "crates/cli" and a["src_lines"] > CLI_LINES:
            problems.append(f"{src}: the CLI has {a['src_lines']} lines in src/ (limit {CLI_LINES}; {a['test_lines']} in tests/)")
        if folder in JSON_CRATES:
            json_sites += a["json"]
    if len(json_sites) > JSON_LIMIT:
        where = ", ".join(f"{p}:{line}" for p, line in json_sites)
        problems.append(f"{json_sites[0][0]}:{json_sites[0][1]}: json! in {len(json_sites)} places in {' + '.join(JSON_CRATES)} (limit {JSON_LIMIT}; use Serialize types): {where}")
    for p in problems:
        print(p)
    print(f"module-map.py --check: {len(problems)} problems in {len(crates)} crates")
    return 1 if problems else 0


def main():
    args = sys.argv[1:]
    limit = FUNCTION_LINES
    if "--functions" in args:
        i = args.index("--functions")
        limit = int(args[i + 1])
        del args[i : i + 2]
    if "--check" in args:
        os.chdir(ROOT)
        sys.exit(check())
    crates = [os.path.relpath(os.path.abspath(a), ROOT) for a in args]
    os.chdir(ROOT)
    crates = crates or list(workspace_crates().values())
    for crate in crates:
        report(crate, limit)


if __name__ == "__main__":
    main()
