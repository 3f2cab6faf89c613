"""The repo's top-level folders are the subpackages of one package, `verl_moe`.

Wheel: `verl_moe/__init__.py` plus each folder as `verl_moe/<folder>` (this mapping). Checkout and
`pip install -e .`: `verl_moe/__init__.py` sets the package's path to the repo root, so the folders
resolve from the same tree as the `verl_moe` imported (tests/test_package.py checks both).
"""

from setuptools import find_packages, setup

SUBPACKAGES = ("engines", "integrations", "models", "ops", "configs", "tools")

packages, package_dir = ["verl_moe"], {"verl_moe": "verl_moe"}
for folder in SUBPACKAGES:
    packages.append(f"verl_moe.{folder}")
    package_dir[f"verl_moe.{folder}"] = folder
    packages += [f"verl_moe.{folder}.{sub}" for sub in find_packages(folder)]

setup(
    packages=packages,
    package_dir=package_dir,
    package_data={"verl_moe.configs": ["**/*.yaml"]},
)
