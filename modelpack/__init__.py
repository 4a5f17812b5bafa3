"""modelpack: safetensors checkpoints as verified, signed CNCF ModelPack OCI artifacts.

One import namespace: ``modelpack`` (core, distribution, CLI), ``modelpack.mediatypes`` (the
contract), ``modelpack.signing`` (trust), ``modelpack.mount`` (node cache),
``modelpack.loader`` (weights → GPU).
"""

from __future__ import annotations

import os as _os

__version__ = "0.1.0"


def _source_checkout_path() -> None:
    # In a source checkout the sub-packages are the sibling folders (mediatypes/, signing/, …)
    # that setuptools maps into this namespace when installing. Searching the checkout root as
    # well lets a working tree (and an editable install's link tree, which only links files that
    # existed at install time) import every module straight from the source.
    here = _os.path.dirname(_os.path.realpath(__file__))
    root = _os.path.dirname(here)
    if _os.path.isfile(_os.path.join(root, "pyproject.toml")) and _os.path.isfile(
        _os.path.join(root, "mediatypes", "__init__.py")
    ):
        __path__[:] = [here, root]


_source_checkout_path()

# The public API, importable as ``modelpack.pack(...)`` etc. Resolved on first use so that
# ``import modelpack`` (and so every CLI start) stays cheap.
_PUBLIC_API = {
    "pack": "modelpack.api.artifacts",
    "inspect": "modelpack.api.artifacts",
    "list_tags": "modelpack.api.artifacts",
    "push": "modelpack.api.transfer",
    "pull": "modelpack.api.transfer",
    "cp": "modelpack.api.transfer",
    "tag": "modelpack.api.transfer",
    "login": "modelpack.api.transfer",
    "logout": "modelpack.api.transfer",
    "copy": "modelpack.transfer.copy",
    "open_target": "modelpack.targets.opener",
    "open_readable": "modelpack.targets.opener",
    "TargetOptions": "modelpack.targets.opener",
    "ModelpackError": "modelpack.errors",
}


def __getattr__(name: str) -> object:
    module = _PUBLIC_API.get(name)
    if module is None:
        raise AttributeError(f"module 'modelpack' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
