"""The package's import graph runs one way, ops <- models <- {engines, integrations} <- tools, has no cycle
between modules, no module is longer than 600 lines, and the benchmarks sit in one package (tools/bench).
engines and integrations share a layer as
siblings: neither imports the other, except the plugin's registration of the integrations
(`SIBLING_IMPORTS`).

The graph is read from the source with `ast` (nothing is imported), every `import` statement counted
wherever it stands: module level, inside a function, under `if TYPE_CHECKING:`, and every string
naming a package module for `importlib` (the ops' `IMPLS` tables). An edge goes to the
module an import names: `from verl_moe.ops import device` is an edge to `verl_moe.ops.device` (a
module), `from verl_moe.models import build` one to `verl_moe.models` (the package's `__init__`).
Parent packages that Python runs on the way are not edges (every submodule would otherwise form a
cycle with an `__init__` that imports it).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "verl_moe"
# lowest first: a module may import its own folder and the layers before it (configs is data, no code);
# folders of one layer are siblings
LAYERS = (("ops",), ("models",), ("engines", "integrations"), ("tools",))
FOLDERS = tuple(folder for group in LAYERS for folder in group)
# (importing module, sibling folder) pairs allowed across one layer: verl's plugin entry point registers
# the VeOmni kernel entries
SIBLING_IMPORTS = {("verl_moe.engines.plugin", "integrations")}
MAX_LINES = 600
# a module named by a string for importlib (dispatch tables: "verl_moe.ops.gdn.chunk:chunk_gated_delta_rule")
LAZY_TARGET = re.compile(r"verl_moe(\.[a-z_][a-z0-9_]*)+(:[A-Za-z_][A-Za-z0-9_]*)?")


def package_modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted name -> file of every module of the package (`verl_moe/__init__.py` and the top-level folders)."""
    modules = {PACKAGE: root / PACKAGE / "__init__.py"}
    for folder in (*FOLDERS, "configs"):
        for path in sorted((root / folder).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((PACKAGE, *parts))] = path
    return modules


def _is_package(name: str, modules: dict[str, Path]) -> bool:
    return modules[name].name == "__init__.py"


def imported_modules(name: str, path: Path, modules: dict[str, Path], lazy: bool = True) -> set[str]:
    """The package's modules that `name` (at `path`) imports, resolved to the module each import names;
    with `lazy`, also those its strings name for importlib."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name if _is_package(name, modules) else name.rpartition(".")[0]
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                origin = f"{base}.{node.module}" if node.module else base
            else:
                origin = node.module
            # `from pkg import sub` names the submodule when one exists, else the package itself
            targets = [f"{origin}.{a.name}" if f"{origin}.{a.name}" in modules else origin for a in node.names]
        elif (
            lazy
            and isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and LAZY_TARGET.fullmatch(node.value)
        ):
            targets = [node.value.partition(":")[0]]  # an import table's "verl_moe.ops.gdn.chunk:name"
        else:
            continue
        for target in targets:
            if target == PACKAGE or target.startswith(PACKAGE + "."):
                # `import verl_moe.ops.gdn.chunk` names that module; a name inside a module names the module
                while target not in modules:
                    target = target.rpartition(".")[0]
                found.add(target)
    found.discard(name)
    return found


def import_graph(root: Path = ROOT, lazy: bool = True) -> dict[str, set[str]]:
    modules = package_modules(root)
    return {name: imported_modules(name, path, modules, lazy) for name, path in modules.items()}


def folder(name: str) -> str | None:
    """The top-level folder `name` lives in; None for `verl_moe` itself."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else None


def layer(name: str) -> int | None:
    """Index in LAYERS of the layer `name`'s folder belongs to; None for `verl_moe` and configs."""
    top = folder(name)
    return next((i for i, group in enumerate(LAYERS) if top in group), None)


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Imports of a higher layer, or of a sibling folder outside SIBLING_IMPORTS."""
    bad = []
    for source, targets in sorted(graph.items()):
        for target in sorted(targets):
            low, high = layer(source), layer(target)
            if low is None or high is None:
                continue
            sibling = high == low and folder(source) != folder(target)
            if high > low or (sibling and (source, folder(target)) not in SIBLING_IMPORTS):
                bad.append(f"{source} -> {target}")
    return bad


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def test_no_upward_imports():
    bad = upward_imports(import_graph())
    assert not bad, "imports must run ops <- models <- {engines, integrations} <- tools:\n" + "\n".join(bad)


def test_no_import_cycles():
    # a dispatch table naming its kernel module (which imports the table's module for its input
    # checks) is not an import: Python never runs the two in a loop
    cycles = import_cycles(import_graph(lazy=False))
    assert not cycles, "import cycles between modules:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_no_module_over_600_lines():
    long = []
    for path in package_modules().values():
        relative = path.relative_to(ROOT).as_posix()
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES:
            long.append(f"{relative}: {lines} lines")
    assert not long, f"modules over {MAX_LINES} lines:\n" + "\n".join(long)


# the ops' process-wide switches and caches live in ops/common/runtime.py; besides it, only the user-facing
# selectors read the environment (dispatch: VERL_MOE_OPS; device: VERL_MOE_DEVICE / VERL_MOE_DISABLE_NPU)
ENVIRONMENT_READERS = ("ops/common/runtime.py", "ops/dispatch.py", "ops/device.py")


def _environment_uses(path: Path) -> list[int]:
    """Lines of `path` that touch os.environ / os.getenv / os.putenv."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr in ("environ", "getenv", "putenv")
        and isinstance(node.value, ast.Name)
        and node.value.id == "os"
    ]


def test_ops_and_models_keep_environment_state_in_one_place():
    bad = []
    for path in package_modules().values():
        relative = path.relative_to(ROOT).as_posix()
        if not relative.startswith(("ops/", "models/")) or relative in ENVIRONMENT_READERS:
            continue
        bad += [f"{relative}:{line}" for line in _environment_uses(path)]
    assert not bad, "read or set switches through ops/common/runtime.py:\n" + "\n".join(bad)


# the benchmarks (`verl-moe bench` and the modules it runs, the kernel profiles) sit at the tools layer, in one
# package: a module named as a bench or a profile anywhere else is a bench out of place
BENCH_PACKAGE = "verl_moe.tools.bench"
BENCH_NAME = re.compile(r"(?:.+_)?(?:bench|profile)")


def misplaced_benches(modules: dict[str, Path]) -> list[str]:
    """Modules named as a bench or a profile outside BENCH_PACKAGE."""
    return sorted(
        name
        for name in modules
        if BENCH_NAME.fullmatch(name.rpartition(".")[2])
        and name != BENCH_PACKAGE
        and not name.startswith(BENCH_PACKAGE + ".")
    )


def test_benchmarks_live_in_tools_bench():
    bad = misplaced_benches(package_modules())
    assert not bad, f"benchmark code goes in {BENCH_PACKAGE} (tools/bench/):\n" + "\n".join(bad)


@pytest.fixture
def fake_tree(tmp_path) -> Path:
    """A package tree with one upward import (ops -> engines, inside a function), one cycle
    (models.a <-> models.b, one side under TYPE_CHECKING, one a relative import) and one bench outside
    tools/bench (models.step_bench)."""
    files = {
        f"{PACKAGE}/__init__.py": "",
        "ops/__init__.py": "",
        "ops/k.py": "def f():\n    from verl_moe.engines import e\n",
        "ops/t.py": "IMPLS = {'a': 'verl_moe.models.b:B'}\n",
        "models/__init__.py": "",
        "models/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from verl_moe.models.b import B\n",
        "models/b.py": "from .a import A\nfrom verl_moe.ops import j\n",
        "engines/__init__.py": "",
        "engines/e.py": "import verl_moe.models.a\nfrom ..ops.j import g\n",
        "engines/plugin.py": "def register():\n    from verl_moe.integrations import v\n",
        "engines/x.py": "from verl_moe.integrations.v import k\n",
        "integrations/__init__.py": "",
        "integrations/v.py": "from verl_moe.models.a import A\nfrom verl_moe.engines import e\n",
        "ops/j.py": "g = 1\n",
        "models/step_bench.py": "",
        "tools/__init__.py": "",
        "tools/bench/__init__.py": "",
        "tools/bench/model.py": "",
        "tools/bench/gdn_profile.py": "",
        "configs/__init__.py": "",
    }
    for relative, text in files.items():
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text(text)
    return tmp_path


def test_checks_find_planted_problems(fake_tree):
    graph = import_graph(fake_tree)
    assert graph["verl_moe.engines.e"] == {"verl_moe.models.a", "verl_moe.ops.j"}
    assert upward_imports(graph) == [
        "verl_moe.engines.x -> verl_moe.integrations.v",  # a sibling import other than the plugin's
        "verl_moe.integrations.v -> verl_moe.engines.e",
        "verl_moe.ops.k -> verl_moe.engines.e",
        "verl_moe.ops.t -> verl_moe.models.b",
    ]
    assert import_cycles(graph) == [["verl_moe.models.a", "verl_moe.models.b"]]
    assert misplaced_benches(package_modules(fake_tree)) == ["verl_moe.models.step_bench"]
    assert "verl_moe.models.b" not in import_graph(fake_tree, lazy=False)["verl_moe.ops.t"]
    (fake_tree / "ops" / "env.py").write_text("import os\n\n\ndef f():\n    return os.environ.get('X')\n")
    assert _environment_uses(fake_tree / "ops" / "env.py") == [5]
