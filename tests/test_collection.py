"""The GPU suite collects without errors on the machines it meets: `pytest -m gpu --collect-only tests` in a
fresh interpreter where packages are made absent (each name set to None in sys.modules by a sitecustomize, so
`import` raises ModuleNotFoundError and `importlib.util.find_spec` gives None, as for a package that is not
installed):

- verl installed without Ray (`import verl` fails inside verl);
- verl with its stack but none of the optional packages (VeOmni, fla, megatron-core, vLLM, Liger);
- a bare GPU machine: torch, Triton, transformers and the test extra, none of verl's stack nor the optional
  packages.

pytest's plugins are not autoloaded (hydra's would import the absent hydra); the test extra's pytest-timeout is
loaded by name.

Modules that need what is absent must be reported skipped with the reason, never as collection errors, and
every gpu test that needs none of it must still be collected."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent

WITHOUT_RAY = ("ray",)
# verl with its whole stack, none of the optional packages (a `pip install verl-moe` GPU machine)
WITHOUT_OPTIONAL = ("megatron", "fla", "veomni", "vllm", "liger_kernel")
BARE_GPU_MACHINE = ("ray", "verl", "hydra", "omegaconf", "tensordict", "transfer_queue", *WITHOUT_OPTIONAL)


def collect_gpu_tests(absent: tuple[str, ...], tmp_path: Path) -> tuple[int, str, set[str]]:
    """(pytest's exit code, its output, the gpu test ids it collected) with `absent` made absent."""
    site = tmp_path / f"site_{len(absent)}"
    site.mkdir()
    (site / "sitecustomize.py").write_text(f"import sys\nfor name in {absent!r}:\n    sys.modules[name] = None\n")
    env = {
        "PYTHONPATH": str(site),
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp_path),
        "RAY_AUTH_MODE": "disabled",
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
    }
    flags = ["--collect-only", "-q", "-m", "gpu", "-p", "pytest_timeout", "-p", "no:cacheprovider"]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", *flags, str(TESTS)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = result.stdout + result.stderr
    ids = {line for line in result.stdout.splitlines() if "::" in line and not line.startswith(" ")}
    return result.returncode, output, ids


def uses_verl_at_top(test_id: str) -> bool:
    """Whether the test's module imports verl's stack (or our engines / tools) at its top level."""
    source = (ROOT / test_id.split("::")[0]).read_text()
    return re.search(r"^(?:from|import)\s+(?:verl|verl_moe\.engines|verl_moe\.tools|hydra|omegaconf)\b", source, re.M)


@pytest.fixture(scope="module")
def everything(tmp_path_factory):
    code, output, ids = collect_gpu_tests((), tmp_path_factory.mktemp("all"))
    assert code == 0, output[-3000:]
    return ids


@pytest.mark.parametrize(
    "absent",
    [WITHOUT_RAY, WITHOUT_OPTIONAL, BARE_GPU_MACHINE],
    ids=["verl_without_ray", "verl_without_optional", "bare_gpu_machine"],
)
def test_gpu_suite_collects_without_errors(absent, everything, tmp_path):
    code, output, ids = collect_gpu_tests(absent, tmp_path)
    assert code == 0, f"pytest exit {code} with {absent} absent:\n{output[-3000:]}"
    assert not re.search(r"^ERROR ", output, re.M), output[-3000:]
    assert ids <= everything
    # every gpu test is still collected unless its module imports verl's stack at its top (skipped by the
    # conftests, with the reason) or skips itself with the reason (pytest.importorskip at its top)
    skipped_modules = set(re.findall(r"^SKIPPED \[\d+\] (\S+\.py):\d+: ", output, re.M))
    missing = sorted(i for i in everything - ids if not uses_verl_at_top(i) and i.split("::")[0] not in skipped_modules)
    assert not missing, f"{len(missing)} gpu tests lost with {absent} absent, e.g. {missing[:5]}"
