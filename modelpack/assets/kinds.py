"""The kinds of runtime asset modelpack ships, and what of each cache directory is worth shipping.

A kind names a runtime's compile cache: which environment variable points the runtime at it and
which entries are per-process scratch (lock files, half-written temp files, Python's bytecode
cache) that must not travel, because another replica would trip over a lock or read a torn file.
The table is open: ``register_kind`` adds one (an engine's own cache) without touching this file.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from modelpack.errors import AssetKindError

#: The file a pull writes into the directory it materialises (never packed, never shipped).
MARKER_FILE = ".modelpack-asset.json"

_ALWAYS_EXCLUDED = (MARKER_FILE, "__pycache__", "*.pyc", ".tmp-modelpack-*")


@dataclass(frozen=True)
class AssetKind:
    """One runtime cache format. ``exclude`` globs match any single path component."""

    name: str
    description: str
    env_var: str | None = None
    exclude: tuple[str, ...] = ()

    def excluded(self, relpath: str) -> bool:
        """Whether ``relpath`` (``/``-separated, relative to the cache root) stays behind."""
        patterns = (*_ALWAYS_EXCLUDED, *self.exclude)
        return any(fnmatch.fnmatchcase(part, p) for part in relpath.split("/") for p in patterns)


_KINDS: dict[str, AssetKind] = {}


def register_kind(kind: AssetKind) -> AssetKind:
    """Add (or replace) a kind; names are lower-case words so they can travel in annotations."""
    if (
        not kind.name
        or not kind.name.replace("-", "").replace("_", "").isalnum()
        or kind.name != kind.name.lower()
    ):
        raise AssetKindError(f"asset kind {kind.name!r}: use a lower-case word (letters, digits, - or _)")
    _KINDS[kind.name] = kind
    return kind


def get_kind(name: str) -> AssetKind:
    try:
        return _KINDS[name]
    except KeyError:
        raise AssetKindError(f"unknown asset kind {name!r}; known: {', '.join(sorted(_KINDS))}") from None


def kind_names() -> list[str]:
    return sorted(_KINDS)


register_kind(
    AssetKind(
        "inductor",
        "torch.compile's Inductor cache (FX graph and AOTAutograd entries, compiled C++/Triton kernels)",
        env_var="TORCHINDUCTOR_CACHE_DIR",
        # locks/ holds per-process file locks; write_atomic leaves ".<pid>.<tid>.tmp" files behind
        exclude=("locks", "*.lock", "*.tmp"),
    )
)
register_kind(
    AssetKind(
        "triton",
        "Triton's kernel cache (cubins/hsacos and their metadata, one directory per kernel hash)",
        env_var="TRITON_CACHE_DIR",
        # Triton stages each kernel in "tmp.pid_<pid>_<n>" before renaming it into place
        exclude=("tmp.pid_*", "*.tmp.pid_*", "*.lock"),
    )
)
register_kind(
    AssetKind(
        "vllm",
        "vLLM's torch.compile cache, $VLLM_CACHE_ROOT/torch_compile_cache (torch_aot_compile/<hash>/ "
        "and <hash>/rank_<i>_<j>/); the modelpack load format fetches it there before vLLM compiles",
        env_var=None,
        exclude=("locks", "*.lock", "*.tmp"),
    )
)
