"""vLLM's LoRA flags for a base model and its adapters, from the node cache.

``modelpack pull BASE --cache DIR --with-adapters`` publishes the base and each adapter as its
own verified snapshot. vLLM serves them with ``--enable-lora --lora-modules NAME=PATH …``; this
module finds, without any network I/O, the adapters of a cached base and checks each one before
its path is handed to vLLM: its manifest is read from the cache's store and verified against
its digest, it carries the adapter marker, its ``subject`` is the base's digest
(``AdapterBaseMismatchError`` naming both when an adapter named explicitly is for another base),
its name is safe, its snapshot is ready, and its ``adapter_config.json`` is a LoRA config whose
rank fits vLLM's ``--max-lora-rank`` choices. Each must also have passed the trust its base
passed on this node (the cache's per-digest record of what verified it, ``mount.trust``): under a
policy, a record that the policy accepted it for the base's repository; without one, a record
that a key which verified the base verified it too. A node cache is shared by jobs, and one of
them may have pulled an adapter without any policy: such an adapter is left out (named in
``left_out``), or fails the call when it was named explicitly. vLLM itself then reads the files
from the read-only snapshot, holding its reader lease while it serves it
(``serving.adapter_leases``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from modelpack.errors import AdapterError, AdapterUntrustedError, ManifestError, ModelpackError, NotFoundError
from modelpack.oci.descriptor import Manifest, parse_manifest_or_index
from modelpack.oci.digest import Digest, verify_bytes
from modelpack.oci.reference import Reference, parse_reference
from modelpack.packing.adapter import ADAPTER_CONFIG, adapter_name_of, read_adapter_config
from modelpack.packing.adapter_referrers import check_adapter_for_base

if TYPE_CHECKING:
    from modelpack.mount.cache import NodeCache
    from modelpack.signing.verify import PolicyOrKeys

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


@dataclass(frozen=True)
class CachedAdapters:
    """What ``cache lora-args`` serves: the adapters, and one line per adapter left out (why)."""

    served: list[ServedAdapter]
    left_out: list[str]


class _BaseTrust:
    """Which cached adapters passed the trust their base passed on this node (no network).

    With ``policy`` the base and each adapter must have a record that an earlier pull verified
    it under that policy, evaluated for the base's repository (``TrustRecords.trusted_locally``).
    Without one, the base's own record decides: a base that keys verified accepts only adapters
    that one of those keys verified; a base nothing verified accepts every adapter (there is no
    trust to inherit)."""

    def __init__(self, cache: NodeCache, base: str, base_digest: str, policy: PolicyOrKeys | None) -> None:
        self.cache = cache
        self.policy = policy
        self.base_keys: set[str] = set()
        self.ref: Reference | None = None
        if policy is None:
            self.base_keys = {str(k) for k in cache.trust.read(base_digest).get("key_ids", [])}
            return
        if base.startswith("sha256:"):
            raise AdapterError(
                f"{base}: with a policy, name the base by reference (host/repo@sha256:…), so the policy's "
                "rule for its repository applies"
            )
        ref = parse_reference(base)
        if not cache.trust.trusted_locally(base_digest, ref, policy):
            raise AdapterUntrustedError(
                f"base {base}",
                base_digest,
                "no record on this node that it passed this policy (pulled without it, or verified by other "
                f"keys); pull it with 'modelpack pull --cache {cache.root} --policy FILE {base}' first",
            )
        self.ref = dataclasses.replace(ref, tag=None)

    def refusal(self, digest: str) -> str | None:
        """Why the adapter ``digest`` is not served with this base, or None when it may be."""
        if self.policy is not None:
            assert self.ref is not None
            ref = dataclasses.replace(self.ref, digest=Digest(digest))
            if self.cache.trust.trusted_locally(digest, ref, self.policy):
                return None
            return (
                "no record on this node that it passed the policy the base passed (another job pulled it "
                "without that policy, or keys the policy does not trust verified it)"
            )
        if not self.base_keys:
            return None
        verified_by = {str(k) for k in self.cache.trust.read(digest).get("key_ids", [])}
        if verified_by & self.base_keys:
            return None
        keys = ", ".join(sorted(k if k.startswith("keyless:") else k[:16] for k in self.base_keys))
        return (
            f"the base was verified on this node by {keys}, and no record says one of them verified this "
            "adapter (another job pulled it without a policy)"
        )


def cached_adapters(
    cache: NodeCache, base: str, adapters: Sequence[str] = (), *, policy: PolicyOrKeys | None = None
) -> list[ServedAdapter]:
    """``select_cached_adapters(...).served``."""
    return select_cached_adapters(cache, base, adapters, policy=policy).served


def select_cached_adapters(
    cache: NodeCache, base: str, adapters: Sequence[str] = (), *, policy: PolicyOrKeys | None = None
) -> CachedAdapters:
    """The adapters to serve with the cached base ``base`` (a reference or digest the cache
    knows), sorted by name: every cached adapter whose subject is the base, or, with
    ``adapters`` (references or digests the cache knows), exactly those, each of which must be
    for this base (``AdapterBaseMismatchError`` otherwise). Each must have passed the trust the
    base passed on this node (``_BaseTrust``; ``policy``: a ``TrustPolicy`` or public keys): one
    found in the cache that did not is left out, with a line in ``left_out``; one named in
    ``adapters`` fails (``AdapterUntrustedError``). No network I/O."""
    base_digest = str(cache.resolve_local(base))
    if cache.snapshots.ready(base_digest) is None:
        raise NotFoundError(
            f"{base}: base {base_digest} is not ready in {cache.root}; pull it --with-adapters"
        )
    trust = _BaseTrust(cache, base, base_digest, policy)
    if adapters:
        chosen = [(ref, str(cache.resolve_local(ref))) for ref in adapters]
    else:
        entries = [str(e.get("digest")) for e in cache.store.index_entries() if e.get("digest")]
        chosen = [(d, d) for d in dict.fromkeys(entries)]
    found: dict[str, ServedAdapter] = {}
    left_out: list[str] = []
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
        refusal = trust.refusal(digest)  # before names are compared: an untrusted twin never blocks
        if refusal is not None:
            if adapters:
                raise AdapterUntrustedError(f"adapter {name} ({ref})", digest, refusal)
            left_out.append(f"adapter {name} ({digest}) left out: {refusal}")
            continue
        if name in found and found[name].digest != digest:
            raise AdapterError(
                f"two cached adapters of {base_digest} are named {name!r}: {found[name].digest} and {digest}"
            )
        rank = read_adapter_config(os.path.join(info.path, ADAPTER_CONFIG)).rank
        found[name] = ServedAdapter(name, info.path, digest, rank)
    return CachedAdapters([found[k] for k in sorted(found)], left_out)


def adapters_for_pod(
    base: str, adapters: Sequence[str], cache_path: str, target_options: Any = None
) -> tuple[list[str], list[ServedAdapter]]:
    """For a pod spec written now and run later: each adapter reference pinned, checked against
    the pinned ``base`` (subject, marker, name), its LoRA rank read from its verified
    ``adapter_config.json`` blob, and the snapshot path it will have under ``cache_path``
    once the init container pulled it. Returns (pinned references, adapters as served)."""
    from modelpack.mediatypes.annotations import layer_filepath
    from modelpack.mount.k8s import snapshot_path
    from modelpack.packing.adapter import MAX_ADAPTER_CONFIG_BYTES, parse_adapter_config
    from modelpack.packing.adapter_referrers import fetch_verified_manifest
    from modelpack.targets.opener import TargetOptions, open_readable

    base_ref = parse_reference(base)
    if base_ref.digest is None:
        raise AdapterError(f"{base}: the base must be pinned by digest to name its adapters")
    pinned: list[str] = []
    served: list[ServedAdapter] = []
    for text in adapters:
        ref = parse_reference(text)
        target = open_readable(ref, (target_options or TargetOptions.from_environ()).bound_to(ref))
        desc = target.resolve(ref.identifier)
        manifest = fetch_verified_manifest(target, desc, "adapter manifest")
        name = check_adapter_for_base(manifest, text, str(desc.digest), str(base_ref.digest))
        layer = next((x for x in manifest.layers if layer_filepath(x.annotations) == ADAPTER_CONFIG), None)
        if layer is None or layer.size > MAX_ADAPTER_CONFIG_BYTES:
            raise AdapterError(
                f"{text} ({desc.digest}): no {ADAPTER_CONFIG} of at most {MAX_ADAPTER_CONFIG_BYTES} bytes"
            )
        with target.fetch_blob(layer) as f:
            data = f.read(layer.size + 1)
        verify_bytes(data, layer.digest, layer.size, what=ADAPTER_CONFIG, source=target.name)
        rank = parse_adapter_config(data, f"{text} {ADAPTER_CONFIG}").rank
        if any(a.name == name for a in served):
            raise AdapterError(f"two adapters named {name!r}: pass one of them")
        pinned.append(str(dataclasses.replace(ref, tag=None, digest=desc.digest)))
        served.append(ServedAdapter(name, snapshot_path(cache_path, desc.digest.hex), str(desc.digest), rank))
    return pinned, sorted(served, key=lambda a: a.name)


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


__all__ = [
    "VLLM_MAX_LORA_RANKS",
    "CachedAdapters",
    "ServedAdapter",
    "adapters_for_pod",
    "cached_adapters",
    "select_cached_adapters",
    "vllm_lora_args",
]
