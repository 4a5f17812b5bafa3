"""Package discovery from the tree: every package under the five source folders, no hand-kept list.

The repository keeps the chain's layers as top-level folders (``modelpack/ mediatypes/ signing/
mount/ loader/``) that install as one namespace, ``modelpack.*``. setuptools' automatic discovery
cannot express that mapping, so this file computes it; the metadata stays in pyproject.toml.
tests/test_wheel.py checks that the built wheel holds every module of these folders.
"""

from setuptools import find_packages, setup

# folder in the repository → import name it installs as
SOURCE_FOLDERS = {
    "modelpack": "modelpack",
    "mediatypes": "modelpack.mediatypes",
    "signing": "modelpack.signing",
    "mount": "modelpack.mount",
    "loader": "modelpack.loader",
}


def _packages() -> list[str]:
    found: list[str] = []
    for folder, name in SOURCE_FOLDERS.items():
        found.append(name)
        found.extend(f"{name}.{sub}" for sub in find_packages(folder))
    return sorted(found)


setup(
    packages=_packages(),
    package_dir={name: folder for folder, name in SOURCE_FOLDERS.items()},
)
