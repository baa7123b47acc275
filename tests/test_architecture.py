"""The layout's rules, read from the source with ``ast``.

* jaxmem's modules form one direction of flow: trace → graph → symbolic → memory →
  plan → rewrite → lower → dispatch; no module imports from a later stage.
* No import cycles anywhere in the project, lazy (in-function) imports included.
* No module imports a private name from another module or reaches into another
  object's private attributes.
* Source files stay under 400 lines; jaxmem's functions under 60.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("jaxmem", "hlo_passes", "models", "train", "bench")

#: jaxmem's modules by stage, in the order data flows; a module may import only from
#: its own stage or earlier ones. Stage 0 is the vocabulary every stage speaks.
STAGES: tuple[tuple[str, ...], ...] = (
    ("jaxmem.errors", "jaxmem.units", "jaxmem.dims", "jaxmem.fastexpr", "jaxmem.exprjson",
     "jaxmem.regions", "jaxmem.grad", "jaxmem.perf"),
    ("jaxmem.trace", "jaxmem.unroll"),
    ("jaxmem.graph",),
    ("jaxmem.symbolic",),
    ("jaxmem.memory", "jaxmem.analyze"),
    ("jaxmem.plan", "jaxmem.schedulers"),
    ("jaxmem.rewrite",),
    ("jaxmem.lower",),
    ("jaxmem.dispatch",),
)


def module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def project_files() -> dict[str, pathlib.Path]:
    files = {}
    for pkg in (*PACKAGES, "tests", "examples"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            files[module_name(path)] = path
    return files


FILES = project_files()


def imports(path: pathlib.Path) -> list[tuple[str, str | None, int]]:
    """``(module, imported name or None, line)`` for every import, nested ones included."""
    out = []
    tree = ast.parse(path.read_text())
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(
        ".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend((a.name, None, node.lineno) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for a in node.names:
                if f"{base}.{a.name}" in FILES:
                    out.append((f"{base}.{a.name}", None, node.lineno))
                else:
                    out.append((base, a.name, node.lineno))
    return out


def stage_of(module: str) -> int | None:
    for rank, prefixes in enumerate(STAGES):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return rank
    return None


def test_every_jaxmem_module_has_a_stage() -> None:
    missing = [m for m in FILES if m.startswith("jaxmem.") and stage_of(m) is None]
    assert not missing, f"add these modules to STAGES: {missing}"


def test_no_jaxmem_module_imports_from_a_later_stage() -> None:
    bad = []
    for mod, path in FILES.items():
        own = stage_of(mod)
        if own is None:
            continue
        for target, _, line in imports(path):
            theirs = stage_of(target)
            if target == "jaxmem" or (theirs is not None and theirs > own):
                bad.append(f"{path.relative_to(ROOT)}:{line} ({STAGES[own][0]}) imports "
                           f"{target}")
    assert not bad, "\n".join(bad)


def _graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {m: set() for m in FILES}
    for mod, path in FILES.items():
        for target, _, _ in imports(path):
            if target in FILES and target != mod:
                edges[mod].add(target)
    return edges


def find_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every back edge of a depth-first walk, as the cycle it closes."""
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for t in sorted(edges.get(m, ())):
            if state.get(t) == 1:
                cycles.append(stack[stack.index(t):] + [t])
            elif t not in state:
                visit(t, [*stack, t])
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m, [m])
    return cycles


def private_reaches(source: str) -> list[tuple[int, str]]:
    """``obj._name`` uses of a private attribute that this module does not define itself.

    ``self._x``/``cls._x`` are always the module's own; so is ``other._x`` where the
    module assigns or defines ``_x`` (another instance of its own class).
    """
    tree = ast.parse(source)
    own = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
           and isinstance(n.ctx, ast.Store)}
    own |= {n.name for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    return [(n.lineno, n.attr) for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and n.attr.startswith("_")
            and not n.attr.startswith("__") and n.attr not in own
            and not (isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"))]


def test_no_import_cycles() -> None:
    cycles = find_cycles(_graph())
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_no_private_names_cross_modules() -> None:
    bad = []
    for mod, path in FILES.items():
        for target, name, line in imports(path):
            if (name and name.startswith("_") and not name.startswith("__")
                    and target in FILES and target != mod):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {target}.{name}")
        bad.extend(f"{path.relative_to(ROOT)}:{line} reaches into .{attr}"
                   for line, attr in private_reaches(path.read_text()))
    assert not bad, "\n".join(bad)


def test_source_files_are_short() -> None:
    long = {str(p.relative_to(ROOT)): n for p in FILES.values()
            if (n := len(p.read_text().splitlines())) > 400}
    assert not long, f"files over 400 lines: {long}"


def test_jaxmem_functions_are_short() -> None:
    long = [f"{p.relative_to(ROOT)}:{f.lineno} {f.name} ({f.end_lineno - f.lineno + 1} lines)"
            for m, p in FILES.items() if m.startswith("jaxmem")
            for f in ast.walk(ast.parse(p.read_text()))
            if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
            and f.end_lineno - f.lineno + 1 > 60]
    assert not long, "\n".join(long)


def test_the_checkers_find_what_they_look_for() -> None:
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []
    assert private_reaches("x = obj._secret\ny = self._mine\nz = a.__dict__\n") == [
        (1, "_secret")]
    assert private_reaches("self._mine = 1\nx = other._mine\n") == []
    assert stage_of("jaxmem.plan.levels") < stage_of("jaxmem.lower") < stage_of(
        "jaxmem.dispatch.jit")
    assert stage_of("bench.compare") is None
