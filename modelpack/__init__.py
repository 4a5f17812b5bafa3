"""modelpack: safetensors checkpoints as verified, signed CNCF ModelPack OCI artifacts.

One import namespace: ``modelpack`` (core, distribution, CLI), ``modelpack.mediatypes`` (the
contract), ``modelpack.signing`` (trust), ``modelpack.mount`` (node cache),
``modelpack.loader`` (weights → GPU). In the repository those four are the top-level folders of
the same names; setup.py maps them into this namespace, for a wheel and for an editable install
alike (setuptools' editable finder maps exactly the packages the wheel holds, nothing else of the
checkout).
"""

from __future__ import annotations

from modelpack._version import __version__ as __version__

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
    "PullOptions": "modelpack.transfer.pull_options",
    # what pull(policy=, variant=) takes, and the trust step every entry point goes through
    "TrustPolicy": "modelpack.signing.policy",
    "load_public_key": "modelpack.signing.keys",
    "VariantSelector": "modelpack.oci.variant_selection",
    "resolve_trusted": "modelpack.mount.resolve",
    "Pinned": "modelpack.mount.resolve",
    "ModelpackError": "modelpack.errors",
    "SignatureRefused": "modelpack.errors",
    "RollbackRefused": "modelpack.errors",
}


def __getattr__(name: str) -> object:
    module = _PUBLIC_API.get(name)
    if module is None:
        raise AttributeError(f"module 'modelpack' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
