"""The distribution: one `verl_moe` tree, whichever way it is reached.

In the checkout the repo root is the package (`verl_moe/__init__.py` points the package's path at
the root); in a wheel the top-level folders sit under `verl_moe/`. Every module must resolve inside
the tree its `verl_moe` came from, even when another tree's editable install is on the import path
(the finder setuptools writes for `pip install -e`, which maps `verl_moe.<sub>` to that checkout's
folders and used to answer for the checkout's subpackages when run from its root).
"""

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("engines", "integrations", "models", "ops", "configs", "tools")

# Resolve every name the way `import` does (each finder of sys.meta_path in turn, asked with the
# parent package's search path) without running any module but `verl_moe/__init__.py`, after
# appending a finder shaped like setuptools' editable one that maps each `verl_moe.<folder>` to a
# decoy tree. Prints {name: origin}.
RESOLVE = r"""
import importlib.machinery, json, sys
names, decoy = json.loads(sys.argv[1]), json.loads(sys.argv[2])

class DecoyEditableFinder:
    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if fullname in decoy:
            return importlib.util.spec_from_file_location(
                fullname, decoy[fullname] + "/__init__.py", submodule_search_locations=[decoy[fullname]])
        parent = fullname.rpartition(".")[0]
        if parent in decoy:
            return importlib.machinery.PathFinder.find_spec(fullname, [decoy[parent]])
        return None

import importlib.util
# first after the path finder: ahead of any editable finder this environment already has
sys.meta_path.insert(sys.meta_path.index(importlib.machinery.PathFinder) + 1, DecoyEditableFinder)
import verl_moe
locations = {"verl_moe": list(verl_moe.__path__)}
origins = {"verl_moe": verl_moe.__file__}
for name in sorted(names, key=lambda n: n.count(".")):
    search = locations[name.rpartition(".")[0]]
    try:
        spec = next(filter(None, (f.find_spec(name, search) for f in sys.meta_path if hasattr(f, "find_spec"))), None)
    except Exception as error:  # a finder that needs the real import (a namespace portion elsewhere)
        spec, origins[name] = None, f"not resolvable without importing: {error!r}"
    else:
        origins[name] = spec.origin if spec else None
    if spec and spec.submodule_search_locations:
        locations[name] = list(spec.submodule_search_locations)
print(json.dumps(origins))
"""


def module_files(tree: Path) -> list[Path]:
    """Every .py file under `tree`'s FOLDERS, relative to `tree` (the wheel's `verl_moe/` folder, or the checkout)."""
    return sorted(path.relative_to(tree) for folder in FOLDERS for path in (tree / folder).rglob("*.py"))


def module_names(tree: Path) -> list[str]:
    """Dotted names of the modules under `tree`'s FOLDERS."""
    names = []
    for path in module_files(tree):
        parts = path.with_suffix("").parts
        names.append(".".join(("verl_moe", *(parts[:-1] if parts[-1] == "__init__" else parts))))
    return sorted(names)


def test_every_folder_of_modules_is_a_package():
    """setup.py lists packages with find_packages: a folder without `__init__.py` would be left out of the wheel."""
    missing = {f"{p.parent}/__init__.py" for p in module_files(ROOT) if not (ROOT / p.parent / "__init__.py").is_file()}
    assert not missing, sorted(missing)


def decoy_tree(tmp_path: Path) -> dict[str, str]:
    """Another checkout's editable mapping: each `verl_moe.<folder>` -> an empty package elsewhere."""
    mapping = {}
    for folder in FOLDERS:
        (tmp_path / "decoy" / folder).mkdir(parents=True)
        (tmp_path / "decoy" / folder / "__init__.py").write_text("")
        mapping[f"verl_moe.{folder}"] = str(tmp_path / "decoy" / folder)
    return mapping


def resolve(names: list[str], decoy: dict[str, str], **kwargs) -> dict[str, str | None]:
    command = [sys.executable, "-c", RESOLVE, json.dumps(names), json.dumps(decoy)]
    result = subprocess.run(command, capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def outside(origins: dict[str, str | None], tree: Path) -> list[str]:
    """Entries that resolved to nothing or outside `tree`."""
    return [f"{n}: {origin}" for n, origin in origins.items() if not origin or not Path(origin).is_relative_to(tree)]


def test_checkout_resolves_in_one_tree_from_the_root(tmp_path):
    names = module_names(ROOT)
    assert "verl_moe.ops.gdn.reference" in names and "verl_moe.engines.plugin" in names
    origins = resolve(names, decoy_tree(tmp_path), cwd=ROOT, env={"PATH": "/usr/bin:/bin"})
    assert origins["verl_moe"] == str(ROOT / "verl_moe" / "__init__.py")
    assert not outside(origins, ROOT), outside(origins, ROOT)[:5]


def test_subpackage_init_files_do_not_move_their_path():
    """The resolution above runs no subpackage `__init__`: valid only while none rewrites `__path__`."""
    for name in module_names(ROOT):
        path = ROOT.joinpath(*name.split(".")[1:])
        init = path / "__init__.py"
        if init.is_file():
            assert "__path__" not in init.read_text(), init


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel of a copy of the sources (an in-tree build writes build/ into the checkout, and a
    stale build/lib would ship modules deleted since)."""
    source, out = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("wheel")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for folder in ("verl_moe", *FOLDERS):
        shutil.copytree(ROOT / folder, source / folder, ignore=ignore)
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, source / name)
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    subprocess.run([*cmd, "-w", str(out), str(source)], check=True, capture_output=True)
    (path,) = out.glob("verl_moe-*.whl")
    return path


def test_wheel_layout(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    for folder in FOLDERS:
        assert f"verl_moe/{folder}/__init__.py" in names, folder
    assert "verl_moe/ops/gdn/reference.py" in names
    stray = [n for n in names if not n.startswith(("verl_moe/", "verl_moe-"))]
    assert not stray, f"everything must live under verl_moe/: {stray[:3]}"
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "[verl.plugins]" in text and "verl_moe.engines.plugin" in text
    assert "verl-moe = verl_moe.tools.cli:main" in text


def test_wheel_resolves_in_one_tree_outside_the_repo(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
    )
    names = module_names(target / "verl_moe")
    assert names == module_names(ROOT), "the wheel must hold every module of the checkout"
    # the checkout's editable mapping on the path too: the installed tree must still answer for itself
    checkout = {f"verl_moe.{folder}": str(ROOT / folder) for folder in FOLDERS}
    origins = resolve(names, checkout, cwd=tmp_path, env={"PYTHONPATH": str(target)})
    assert not outside(origins, target), outside(origins, target)[:5]
    code = "import verl_moe.ops, verl_moe.models, verl_moe.engines.plugin, verl_moe.configs, verl_moe.tools"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path, env={"PYTHONPATH": str(target)})
