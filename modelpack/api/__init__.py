"""The Python API behind the CLI: every command is a function a Python user can call.

``artifacts`` builds and describes artifacts (pack, inspect, list_tags); ``transfer`` moves them
between targets (push, pull, cp, tag, login, logout).
"""

from __future__ import annotations

from modelpack.api.artifacts import ArtifactSummary, LayerSummary, PackResult, inspect, list_tags, pack
from modelpack.api.transfer import PushResult, cp, login, logout, pull, push, tag
from modelpack.targets.fetch import fetch_config, fetch_manifest

__all__ = [
    "ArtifactSummary",
    "LayerSummary",
    "PackResult",
    "PushResult",
    "cp",
    "fetch_config",
    "fetch_manifest",
    "inspect",
    "list_tags",
    "login",
    "logout",
    "pack",
    "pull",
    "push",
    "tag",
]
