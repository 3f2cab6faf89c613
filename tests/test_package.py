"""The distribution: a real wheel holds every subpackage under one `verl_moe` namespace."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    subprocess.run([*cmd, "-w", str(out), str(ROOT)], check=True, capture_output=True)
    (path,) = out.glob("verl_moe-*.whl")
    return path


def test_wheel_layout(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    for folder in ("engines", "models", "ops", "configs", "tools"):
        assert f"verl_moe/{folder}/__init__.py" in names, folder
    assert "verl_moe/ops/gdn/reference.py" in names
    stray = [n for n in names if n.startswith(("tests/", "engines/", "ops/"))]
    assert not stray, f"folders must live under verl_moe/: {stray[:3]}"
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "[verl.plugins]" in text and "verl_moe.engines.plugin" in text
    assert "verl-moe = verl_moe.tools.cli:main" in text


def test_wheel_imports_outside_the_repo(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
    )
    code = (
        "import pathlib, verl_moe, verl_moe.ops, verl_moe.models, verl_moe.engines.plugin, verl_moe.configs, "
        f"verl_moe.tools; assert pathlib.Path(verl_moe.ops.__file__).is_relative_to(pathlib.Path(r'{target}'))"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path, env={"PYTHONPATH": str(target)})
