"""The package's shape: layers import downward only, no import cycles between modules, and no
module imports another module's private names (DESIGN.md, "Shape of the package")."""

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lowbit"

# What each part of lowbit may import (lazily or not). The top-level `lowbit/__init__.py` is
# the public facade and may import anything.
ALLOWED = {
    "files": set(),      # lowbit.files: atomic writes, below everything
    "config": set(),     # lowbit.config: require and RunConfig, below everything
    "formats": {"files", "config"},
    "kernels": {"files", "config", "formats"},
    "dispatch": {"files", "config", "formats", "kernels"},
    "recipes": {"files", "config", "formats"},
    "models": {"files", "config"},
    "data": {"files", "config"},
    "ops": {"files", "config", "formats", "kernels", "dispatch", "recipes"},
    "nn": {"files", "config", "formats", "dispatch", "ops", "recipes", "models"},
    "diagnostics": {"files", "config", "formats", "dispatch", "ops", "recipes", "nn"},
    "train": {"files", "config", "formats", "kernels", "dispatch", "ops", "recipes", "nn",
              "models", "data", "diagnostics"},
    "export": {"files", "config", "formats", "kernels", "dispatch", "ops", "recipes", "nn",
               "models", "data", "diagnostics", "train"},
    "qat": {"files", "config", "formats", "kernels", "dispatch", "ops", "recipes", "nn", "models",
            "data", "diagnostics", "train", "export"},
    "rl": {"files", "config", "formats", "kernels", "dispatch", "ops", "recipes", "nn", "models",
           "data", "diagnostics", "train", "qat", "export"},
    "bench": {"files", "config", "formats", "kernels", "dispatch", "ops", "recipes", "nn",
              "models", "data", "diagnostics", "train", "export", "qat", "rl"},
    "cli": {"files", "config", "formats", "kernels", "dispatch", "ops", "recipes", "nn", "models",
            "data", "diagnostics", "train", "qat", "rl", "bench", "export"},
    "__main__": {"cli"},   # `python -m lowbit`
}


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path):
    """(imported module, names taken from it, line) for every import in the file, lazy ones
    (inside functions) included."""
    tree = ast.parse(path.read_text(), str(path))
    this = module_name(path)
    package = this if path.name == "__init__.py" else this.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, [], node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [a.name for a in node.names]
            # `from lowbit.kernels import quantize as kq` imports a module, not a name
            modules = [f"{target}.{n}" for n in names if _is_module(f"{target}.{n}")]
            if modules:
                for m in modules:
                    yield m, [], node.lineno
                names = [n for n in names if f"{target}.{n}" not in modules]
            if names:
                yield target, names, node.lineno


def _is_module(name: str) -> bool:
    path = PACKAGE.parent / name.replace(".", "/")
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def files():
    return sorted(PACKAGE.rglob("*.py"))


def part(module: str) -> str | None:
    pieces = module.split(".")
    return pieces[1] if len(pieces) > 1 and pieces[0] == "lowbit" else None


def test_layers_import_downward():
    wrong = []
    for path in files():
        this = module_name(path)
        if this == "lowbit":
            continue
        mine = part(this)
        for target, _, line in imports(path):
            theirs = part(target)
            if target == "lowbit" and mine != "cli":   # the command may read __version__
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports the facade `lowbit`")
            elif theirs is not None and theirs != mine and theirs not in ALLOWED[mine]:
                wrong.append(f"{path.relative_to(ROOT)}:{line}: {mine} imports {target}")
    assert not wrong, "\n".join(wrong)


def test_every_part_has_a_layer():
    parts = {part(module_name(p)) for p in files()} - {None}
    assert parts <= set(ALLOWED), parts - set(ALLOWED)


def test_no_import_cycles_between_modules():
    known = {module_name(p) for p in files()}
    graph = defaultdict(set)
    for path in files():
        this = module_name(path)
        for target, _, _ in imports(path):
            while target and target not in known:       # a name inside a module
                target = target.rpartition(".")[0]
            if target and target != this and target != "lowbit":
                # a package's __init__ importing its own submodules is how packages re-export
                if not target.startswith(this + "."):
                    graph[this].add(target)
    cycles, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(known):
        if node not in state:
            visit(node, [node])
    assert not cycles, "\n".join(cycles)


def test_no_private_names_imported_across_modules():
    wrong = []
    for path in [*files(), *sorted((ROOT / "tests").glob("*.py")),
                 *sorted((ROOT / "benchmarks").glob("*.py"))]:
        for target, names, line in imports(path):
            if target.startswith("lowbit"):
                private = [n for n in names if n.startswith("_") and not n.startswith("__")]
                if private:
                    wrong.append(f"{path.relative_to(ROOT)}:{line}: from {target} import "
                                 f"{', '.join(private)}")
        text = path.read_text()
        tree = ast.parse(text)
        aliases = {a.asname or a.name for n in ast.walk(tree)
                   if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names
                   if (isinstance(n, ast.Import) and a.name.startswith("lowbit"))
                   or (isinstance(n, ast.ImportFrom) and (n.module or "").startswith("lowbit"))}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                wrong.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value.id}.{node.attr}")
    assert not wrong, "\n".join(wrong)
