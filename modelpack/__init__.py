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
