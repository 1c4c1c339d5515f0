"""The layer rule: imports point down only, and no two packages or modules import each other in a circle.

Every module under novatune/ is parsed, imports inside functions included (a lazy import is still a dependency).
A package may import a package of a lower rank, or another package of its own rank as long as no circle forms.
"""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[1] / "novatune"

# rank: higher may import lower. The package face (novatune/__init__.py, __main__.py) sits on top with commands.
RANKS = {
    "<face>": 10, "commands": 8,
    "report": 7,
    "bench": 6, "proof": 6, "eval": 6, "tune": 6,
    "train": 5,
    "memory": 4, "parallel": 4,
    "patch": 3,
    "ops": 2,
    "kernels": 1, "reference": 1, "attention": 1, "data": 1, "measure": 1,
    "version": 0, "assets": 0,
}


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE_ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in ("__main__",):
        return "<face>"
    return parts[1]


def imports_of(path: Path, module: str) -> set[str]:
    """Absolute novatune module names imported anywhere in the file (relative imports resolved)."""
    is_pkg = path.name == "__init__.py"
    found = set()
    tree = ast.parse(path.read_text(), filename=str(path))
    for block in ast.walk(tree):  # `if TYPE_CHECKING:` imports exist for annotations only, never at run time
        if not isinstance(block, ast.If):
            continue
        if getattr(block.test, "id", getattr(block.test, "attr", None)) == "TYPE_CHECKING":
            block.body = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "novatune")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_pkg else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "novatune":
                continue
            for alias in node.names:  # `from novatune.x import y` may name a submodule y
                sub = f"{target}.{alias.name}"
                found.add(sub if _is_module(sub) else target)
    found.discard(module)
    return found


def _is_module(name: str) -> bool:
    p = PACKAGE_ROOT.parent.joinpath(*name.split("."))
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def graph() -> dict[str, set[str]]:
    return {module_name(p): imports_of(p, module_name(p)) for p in PACKAGE_ROOT.rglob("*.py")}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(edges.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (c := visit(m)):
                return c
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(edges):
        if n not in state and (c := visit(n)):
            return c
    return None


def test_every_package_has_a_rank():
    packages = {package_of(m) for m in graph()}
    assert packages <= set(RANKS), f"give these packages a rank in RANKS: {sorted(packages - set(RANKS))}"


def test_imports_point_down():
    upward = []
    for mod, targets in graph().items():
        for t in targets:
            src, dst = package_of(mod), package_of(t)
            if src != dst and RANKS[dst] > RANKS[src]:
                upward.append(f"{mod} ({src}) imports {t} ({dst})")
    assert not upward, "imports against the layer direction:\n" + "\n".join(sorted(upward))


def test_no_package_cycle():
    pkg_edges: dict[str, set[str]] = {}
    for mod, targets in graph().items():
        src = package_of(mod)
        pkg_edges.setdefault(src, set()).update(package_of(t) for t in targets if package_of(t) != src)
    assert find_cycle(pkg_edges) is None, f"package cycle: {' -> '.join(find_cycle(pkg_edges))}"


def test_no_module_cycle():
    cycle = find_cycle(graph())
    assert cycle is None, f"module import cycle: {' -> '.join(cycle)}"


def test_argparse_only_in_commands():
    offenders = [module_name(p) for p in PACKAGE_ROOT.rglob("*.py")
                 if package_of(module_name(p)) != "commands" and "argparse" in imports_of_stdlib(p)]
    assert not offenders, f"argparse belongs to novatune/commands only: {offenders}"


def imports_of_stdlib(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def test_the_checker_catches_an_upward_import(tmp_path):
    """The rule itself is tested: a planted upward import and a planted circle are found."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    assert RANKS["ops"] < RANKS["patch"] < RANKS["train"] < RANKS["commands"]
