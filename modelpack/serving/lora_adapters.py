"""vLLM's LoRA flags for a base model and its adapters, from the node cache.

``modelpack pull BASE --cache DIR --with-adapters`` publishes the base and each adapter as its
own verified snapshot. vLLM serves them with ``--enable-lora --lora-modules NAME=PATH …``; this
module finds, without any network I/O, the adapters of a cached base and checks each one before
its path is handed to vLLM: its manifest is read from the cache's store and verified against
its digest, it carries the adapter marker, its ``subject`` is the base's digest
(``AdapterBaseMismatchError`` naming both when an adapter named explicitly is for another base),
its name is safe, its snapshot is ready, and its ``adapter_config.json`` is a LoRA config whose
rank fits vLLM's ``--max-lora-rank`` choices. vLLM itself then reads the files from the
read-only snapshot.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from modelpack.errors import AdapterError, ManifestError, ModelpackError, NotFoundError
from modelpack.oci.descriptor import Manifest, parse_manifest_or_index
from modelpack.oci.digest import Digest, verify_bytes
from modelpack.packing.adapter import ADAPTER_CONFIG, adapter_name_of, read_adapter_config
from modelpack.packing.adapter_referrers import check_adapter_for_base

if TYPE_CHECKING:
    from modelpack.mount.cache import NodeCache

#: vLLM 0.32's ``LoRAConfig.max_lora_rank`` choices (``MaxLoRARanks``)
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass(frozen=True)
class ServedAdapter:
    """One adapter as vLLM will serve it: the name requests use, its snapshot, digest and rank."""

    name: str
    path: str
    digest: str
    rank: int

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "path": self.path, "digest": self.digest, "rank": self.rank}


def _cached_manifest(cache: NodeCache, digest: str) -> Manifest | None:
    try:
        raw = cache.store.read_small(digest)
    except (FileNotFoundError, ModelpackError):
        return None
    verify_bytes(raw, Digest(digest), None, what="cached manifest", source=cache.root)
    parsed = parse_manifest_or_index(raw)
    return parsed if isinstance(parsed, Manifest) else None


def cached_adapters(cache: NodeCache, base: str, adapters: Sequence[str] = ()) -> list[ServedAdapter]:
    """The adapters to serve with the cached base ``base`` (a reference or digest the cache
    knows), sorted by name: every cached adapter whose subject is the base, or, with
    ``adapters`` (references or digests the cache knows), exactly those, each of which must be
    for this base (``AdapterBaseMismatchError`` otherwise). No network I/O."""
    base_digest = str(cache.resolve_local(base))
    if cache.snapshots.ready(base_digest) is None:
        raise NotFoundError(
            f"{base}: base {base_digest} is not ready in {cache.root}; pull it --with-adapters"
        )
    if adapters:
        chosen = [(ref, str(cache.resolve_local(ref))) for ref in adapters]
    else:
        entries = [str(e.get("digest")) for e in cache.store.index_entries() if e.get("digest")]
        chosen = [(d, d) for d in dict.fromkeys(entries)]
    found: dict[str, ServedAdapter] = {}
    for ref, digest in chosen:
        manifest = _cached_manifest(cache, digest)
        if manifest is None or adapter_name_of(manifest) is None:
            if adapters:
                raise AdapterError(f"{ref} ({digest}): not a cached adapter manifest")
            continue
        try:
            name = check_adapter_for_base(manifest, ref, digest, base_digest)
        except (AdapterError, ManifestError):
            if adapters:
                raise  # named explicitly: another base's adapter is refused, not skipped
            continue
        info = cache.snapshots.ready(digest)
        if info is None:
            if adapters:
                raise NotFoundError(f"{ref}: adapter {digest} is not ready in {cache.root}")
            continue
        if name in found and found[name].digest != digest:
            raise AdapterError(
                f"two cached adapters of {base_digest} are named {name!r}: {found[name].digest} and {digest}"
            )
        rank = read_adapter_config(os.path.join(info.path, ADAPTER_CONFIG)).rank
        found[name] = ServedAdapter(name, info.path, digest, rank)
    return [found[k] for k in sorted(found)]


def vllm_lora_args(adapters: Sequence[ServedAdapter], *, max_loras: int | None = None) -> list[str]:
    """``--enable-lora --max-lora-rank R --max-loras N --lora-modules NAME=PATH …`` for vLLM's
    OpenAI server (``R``: the smallest of vLLM's rank choices that fits every adapter)."""
    if not adapters:
        return []
    top = max(a.rank for a in adapters)
    fitting = [r for r in VLLM_MAX_LORA_RANKS if r >= top]
    if not fitting:
        raise AdapterError(
            f"adapter rank {top} is above vLLM's largest --max-lora-rank ({VLLM_MAX_LORA_RANKS[-1]})"
        )
    args = [
        "--enable-lora",
        "--max-lora-rank",
        str(fitting[0]),
        "--max-loras",
        str(max_loras or len(adapters)),
    ]
    args.append("--lora-modules")
    args += [f"{a.name}={a.path}" for a in adapters]
    return args


__all__ = ["VLLM_MAX_LORA_RANKS", "ServedAdapter", "cached_adapters", "vllm_lora_args"]
