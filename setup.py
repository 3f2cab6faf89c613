"""The repo's top-level folders are the subpackages of one import namespace, `verl_moe`."""

from setuptools import find_packages, setup

SUBPACKAGES = ("engines", "models", "ops", "configs", "tools")

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
