"""Materialising the runtime asset built for exactly this environment, or starting cold.

An asset is code the runtime executes, so it is used only when signed by a key the operator
trusts: without a policy (or keys) every pull is refused (``allow_unsigned`` is the one, explicit
opt-out), and under a policy an asset needs a trusted signature even where the rule lets the
weights go unsigned. Order of checks, each a reason to refuse with an event and leave nothing
behind: a trust policy is given; the destination is the caller's (``destination.py``); the
fingerprint must match field for field (a near miss names the differing fields); the asset's
signature must satisfy the policy; the layer must hash to its digest and unpack safely into a
temp directory beside the destination, writing no more than the record's size, the free space
and ``max_bytes``. Only then is that directory renamed into place, with a marker listing every
file's sha256, in one step. A refusal is not an error: the engine compiles from scratch, as it
would have without modelpack.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from modelpack.assets import destination
from modelpack.assets.archive import unpack_layer
from modelpack.assets.destination import AssetMarker, MarkedFile
from modelpack.assets.environment import running_fingerprint
from modelpack.assets.fingerprint import EnvironmentFingerprint, describe
from modelpack.assets.kinds import get_kind
from modelpack.assets.push import FingerprintSource, load_fingerprint
from modelpack.assets.stored import StoredAsset, list_assets, select
from modelpack.errors import (
    AssetError,
    AssetRefused,
    DigestMismatchError,
    LayerFormatError,
    SignatureRefused,
    SizeMismatchError,
    UnsafeTarError,
)
from modelpack.events import EventLog, NullEventLog
from modelpack.files import TEMP_PREFIX, fsync_dir
from modelpack.mount import NodeCache
from modelpack.mount.assets import writable_view
from modelpack.oci.descriptor import Descriptor
from modelpack.oci.reference import Reference, parse_reference
from modelpack.settings import resolve_start_id
from modelpack.signing.policy import RepositoryPolicy
from modelpack.signing.verify import PolicyOrKeys, resolve_policy, verify_artifact
from modelpack.targets.base import ReadableTarget
from modelpack.targets.opener import TargetOptions, open_readable
from modelpack.transfer.untar import ExpansionBudget

STATES = ("hit", "none", "refused")
#: signature statuses: the asset verified under the policy; refused by it; no policy given (so no
#: asset used); unsigned accepted because the caller asked (``allow_unsigned``); "" when no
#: candidate reached the signature check
SIGNATURE_VERIFIED, SIGNATURE_REFUSED = "verified", "refused"
SIGNATURE_NO_POLICY, SIGNATURE_ALLOWED_UNSIGNED = "no policy", "unsigned allowed"
NO_POLICY_REASON = (
    "signature: no trust policy or key given, and an asset is code the runtime executes; give the "
    "policy (or keys) whose signers may ship compile caches, or allow_unsigned / --allow-unsigned "
    "to accept assets nobody signed"
)


@dataclass
class AssetPullResult:
    """``state``: hit (``path`` holds the asset) | none (no asset of this kind) | refused."""

    state: str
    reference: str
    model_digest: str
    kind: str
    fingerprint: EnvironmentFingerprint
    path: str | None = None
    asset: str | None = None
    reason: str = ""
    fields: list[str] = field(default_factory=list)
    candidates: int = 0
    files: int = 0
    bytes: int = 0
    signature: str = ""  # verified | refused | no policy | unsigned allowed ("": not reached)
    present: bool = False  # the destination already held this asset: nothing was downloaded
    duration_ms: float = 0.0

    def environment(self) -> dict[str, str]:
        """The variable that points the runtime at the asset (on a hit, for kinds that have one)."""
        env_var = get_kind(self.kind).env_var
        return {env_var: self.path} if self.state == "hit" and self.path and env_var else {}

    def to_json(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "reference": self.reference,
            "digest": self.model_digest,
            "kind": self.kind,
            "path": self.path,
            "asset": self.asset,
            "reason": self.reason,
            "fields": list(self.fields),
            "candidates": self.candidates,
            "files": self.files,
            "bytes": self.bytes,
            "signature": self.signature,
            "present": self.present,
            "fingerprint": self.fingerprint.to_dict(),
            "fingerprintDigest": self.fingerprint.digest,
            "environment": self.environment(),
            "durationMs": round(self.duration_ms, 3),
        }


def read_marker(path: str) -> AssetMarker | None:
    """The marker a pull left in ``path``, or None (absent, or not one modelpack wrote)."""
    return destination.read_marker(path)


class _Refusal(Exception):
    def __init__(self, reason: str, signature: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.signature = signature


def _asset_policy(policy: PolicyOrKeys, model_ref: Reference) -> RepositoryPolicy:
    """The model repository's rule, for an asset: the same keys, and a signature always required
    (a rule may let weights go unsigned; never code). The directory-signature and chunk-table
    requirements describe weights, not caches."""
    rp = resolve_policy(policy, model_ref)
    return dataclasses.replace(
        rp, require_signature=True, require_directory_signature=False, require_chunk_table=False
    )


def _verify_signature(
    target: ReadableTarget, ref: Reference, asset: StoredAsset, policy: PolicyOrKeys | None, events: EventLog
) -> str:
    if policy is None:  # only reached with allow_unsigned: pull_asset_from refuses otherwise
        return SIGNATURE_ALLOWED_UNSIGNED
    asset_ref = dataclasses.replace(ref, tag=None, digest=asset.descriptor.digest)
    try:
        res = verify_artifact(target, asset_ref, asset.descriptor, _asset_policy(policy, ref), events=events)
    except SignatureRefused as exc:
        raise _Refusal(f"signature: {exc.reason}", SIGNATURE_REFUSED) from exc
    return SIGNATURE_VERIFIED if res.status == "verified" else res.status


Fill = Callable[[str], list[tuple[str, int, str]]]


def free_bytes(directory: str) -> int:
    """Bytes an unprivileged writer may still use on ``directory``'s file system."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def _write_cap(asset: StoredAsset, tmp: str, max_bytes: int | None) -> ExpansionBudget:
    """The most the asset's files may write: what its record says, within the free space and
    ``max_bytes``; refuses up front, before any download, when the record itself is larger."""
    assert asset.record is not None
    declared = asset.record.size
    free = free_bytes(tmp)
    if max_bytes is not None and declared > max_bytes:
        raise _Refusal(
            f"content: the record says {declared} bytes unpacked, more than --max-bytes {max_bytes}"
        )
    if declared > free:
        raise _Refusal(
            f"content: the record says {declared} bytes unpacked; only {free} bytes are free on {tmp}"
        )
    return ExpansionBudget(declared, f"the {declared} bytes the asset's record declares")


def _file_counter(asset: StoredAsset, where: str) -> Callable[[str], bool]:
    """A ``select`` for extraction that refuses the file one past the record's count."""
    assert asset.record is not None
    limit, seen = asset.record.files, [0]

    def select(rel: str) -> bool:
        seen[0] += 1
        if seen[0] > limit:
            raise UnsafeTarError(f"{where}: more than the {limit} files its record declares ({rel!r})")
        return True

    return select


def _from_target(target: ReadableTarget, asset: StoredAsset, max_bytes: int | None) -> Fill:
    """Download the layer and unpack it into the temp directory, digest-checked as it streams and
    capped (bytes and files) by the record before anything is written."""

    def fill(tmp: str) -> list[tuple[str, int, str]]:
        layer = asset.layer
        where = f"{target.name} asset {asset.digest} layer {layer.digest}"
        budget = _write_cap(asset, tmp, max_bytes)
        try:
            with contextlib.closing(target.fetch_blob(layer)) as stream:
                return unpack_layer(
                    stream,
                    str(layer.digest),
                    layer.size,
                    asset.layer_format,
                    tmp,
                    where=where,
                    budget=budget,
                    select=_file_counter(asset, where),
                )
        except (DigestMismatchError, SizeMismatchError, UnsafeTarError, LayerFormatError) as exc:
            raise _Refusal(f"content: {exc}") from exc

    return fill


def _from_cache(
    cache: NodeCache,
    target: ReadableTarget,
    ref: Reference,
    asset: StoredAsset,
    policy: PolicyOrKeys | None,
    start_id: str,
    outcome: dict[str, str],
    max_bytes: int | None,
) -> Fill:
    """Pull the asset into the node cache (one download per node, verified and signature-checked
    there, GC'd with the models), then copy a writable view of it into the temp directory. The
    record must fit ``max_bytes`` and the free space beside ``dest`` before anything is pulled."""

    def fill(tmp: str) -> list[tuple[str, int, str]]:
        _write_cap(asset, tmp, max_bytes)  # refuses up front; the view checks the record again
        asset_ref = dataclasses.replace(ref, tag=None, digest=asset.descriptor.digest)
        try:
            res = cache.pull(
                asset_ref,
                policy=_asset_policy(policy, ref) if policy is not None else None,
                source=target,
                # its own start: the asset's cold/hit must not read as the model's in a timeline
                start_id=f"{start_id}.assets",
            )
        except SignatureRefused as exc:
            raise _Refusal(f"signature: {exc.reason}", SIGNATURE_REFUSED) from exc
        except (DigestMismatchError, SizeMismatchError, UnsafeTarError) as exc:
            raise _Refusal(f"content: {exc}") from exc
        outcome["signature"] = SIGNATURE_VERIFIED if policy is not None else SIGNATURE_ALLOWED_UNSIGNED
        outcome["cache"] = res.state
        assert asset.record is not None
        try:
            return writable_view(
                cache.snapshots, str(res.digest), tmp, files=asset.record.files, size=asset.record.size
            )
        except (DigestMismatchError, AssetError) as exc:
            raise _Refusal(f"content: {exc}") from exc

    return fill


def _materialise(fill: Fill, asset: StoredAsset, dest: str, model: Descriptor) -> list[MarkedFile]:
    """Fill a private temp directory beside ``dest``, check it against the record, write the
    marker (every file's sha256), rename it into place."""
    assert asset.record is not None
    parent = os.path.dirname(dest) or "."
    os.makedirs(parent, mode=0o755, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=TEMP_PREFIX, dir=parent)
    try:
        files = [MarkedFile(rel, size, sha) for rel, size, sha in fill(tmp)]
        n, size = len(files), sum(f.size for f in files)
        if (n, size) != (asset.record.files, asset.record.size):
            raise _Refusal(
                f"content: {n} files / {size} bytes unpacked, the record says "
                f"{asset.record.files} / {asset.record.size}"
            )
        marker = AssetMarker(
            asset.digest, str(model.digest), asset.record.kind, asset.record.fingerprint.digest, tuple(files)
        )
        destination.write_marker(tmp, marker)
        os.chmod(tmp, 0o755)
        fsync_dir(tmp)
        now = destination.inspect(dest)  # again: the caller's, or nothing, right before the swap
        if now.marker is not None:  # an earlier asset: swap, then drop the old one
            old = tempfile.mkdtemp(prefix=TEMP_PREFIX, dir=parent)
            os.rename(dest, os.path.join(old, "old"))
            os.rename(tmp, dest)
            shutil.rmtree(old, ignore_errors=True)
        elif now.empty:
            os.rename(tmp, dest)  # replaces an empty directory in one step
        else:
            raise _not_materialised(dest)
        fsync_dir(parent)
        return files
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _not_materialised(dest: str) -> AssetError:
    return AssetError(
        f"{dest}: not empty and not an asset modelpack materialised; pull into a new directory "
        "(the runtime then reads it through its cache variable)"
    )


def _check_destination(dest: str) -> AssetMarker | None:
    """``dest`` is absent, empty, or an earlier pull's directory, all the caller's; else raises."""
    now = destination.inspect(dest)
    if now.exists and not now.empty and now.marker is None:
        raise _not_materialised(dest)
    return now.marker


def pull_asset_from(
    target: ReadableTarget,
    ref: Reference,
    model: Descriptor,
    dest: str | os.PathLike[str],
    kind: str,
    running: EnvironmentFingerprint,
    *,
    policy: PolicyOrKeys | None = None,
    allow_unsigned: bool = False,
    max_bytes: int | None = None,
    events: EventLog | None = None,
    start_id: str | None = None,
    require_hit: bool = False,
    cache: NodeCache | None = None,
) -> AssetPullResult:
    """The core of ``pull_asset`` for a model already resolved (the loader integration's entry).
    Without ``policy`` every pull is refused unless ``allow_unsigned``."""
    t0 = time.monotonic()
    events = events or NullEventLog()
    start_id = resolve_start_id(start_id)
    get_kind(kind)
    path = os.path.abspath(os.fspath(dest))
    existing = _check_destination(path)
    result = AssetPullResult("none", str(ref), str(model.digest), kind, running)
    common = {"reference": str(ref), "digest": str(model.digest), "kind": kind, "start_id": start_id}
    events.emit("assets.pull_start", **common, fingerprint_digest=running.digest)

    def finish(state: str, **extra: Any) -> AssetPullResult:
        result.state = state
        result.duration_ms = (time.monotonic() - t0) * 1000.0
        events.emit(
            f"assets.{state}",
            **common,
            asset_state=state,
            fingerprint_digest=running.digest,
            candidates=result.candidates,
            duration_ms=round(result.duration_ms, 3),
            **extra,
        )
        if require_hit and state != "hit":
            raise AssetRefused(
                str(ref),
                kind,
                result.reason or "no asset stored",
                asset_digest=result.asset or "",
                fields=result.fields,
            )
        return result

    if policy is None and not allow_unsigned:
        result.reason, result.signature = NO_POLICY_REASON, SIGNATURE_NO_POLICY
        return finish("refused", reason=result.reason, signature=result.signature)
    sel = select(list_assets(target, model, kind), running)
    result.candidates = sel.candidates
    for bad in sel.unusable:
        events.emit("assets.candidate_refused", **common, asset=bad.digest, reason=bad.error)
    if not sel.matches:
        nearest = sel.nearest
        if nearest is None:
            result.reason = (
                f"no {kind} asset stored for {model.digest}"
                if not sel.unusable
                else f"{len(sel.unusable)} {kind} asset(s) unreadable: {sel.unusable[0].error}"
            )
            return finish("none" if not sel.unusable else "refused", reason=result.reason)
        asset, diffs = nearest
        result.asset = asset.digest
        result.fields = [name for name, _, _ in diffs]
        result.reason = f"fingerprint differs: {describe(diffs)}"
        return finish(
            "refused",
            asset=asset.digest,
            fields=result.fields,
            reason=result.reason,
            near_misses=len(sel.near_misses),
        )
    for asset in sel.matches:
        result.asset = asset.digest
        outcome: dict[str, str] = {}
        try:
            if existing is not None and existing.asset == asset.digest and destination.holds(path, existing):
                result.signature = _verify_signature(target, ref, asset, policy, events)
                result.present = True
                files = list(existing.files)
            elif cache is None:
                result.signature = _verify_signature(target, ref, asset, policy, events)
                files = _materialise(_from_target(target, asset, max_bytes), asset, path, model)
            else:
                fill = _from_cache(cache, target, ref, asset, policy, start_id, outcome, max_bytes)
                files = _materialise(fill, asset, path, model)
                result.signature = outcome.get("signature", result.signature)
            result.files, result.bytes = len(files), sum(f.size for f in files)
        except _Refusal as exc:
            result.reason = exc.reason
            result.signature = exc.signature or result.signature
            events.emit("assets.candidate_refused", **common, asset=asset.digest, reason=exc.reason)
            continue
        result.path = path
        result.reason = ""
        return finish(
            "hit",
            asset=asset.digest,
            path=path,
            files=result.files,
            bytes=result.bytes,
            present=result.present,
            signature=result.signature,
            node_cache=outcome.get("cache"),
        )
    return finish("refused", asset=result.asset, reason=result.reason)


def pull_asset(
    model_ref: str | Reference,
    dest: str | os.PathLike[str],
    kind: str,
    *,
    fingerprint: FingerprintSource | None = None,
    device: Any = "cpu",
    tp_size: int = 1,
    dtype: str | None = None,
    quantization: str | None = None,
    policy: PolicyOrKeys | None = None,
    allow_unsigned: bool = False,
    max_bytes: int | None = None,
    target_options: TargetOptions | None = None,
    events: EventLog | None = None,
    start_id: str | None = None,
    require_hit: bool = False,
    cache: NodeCache | str | None = None,
) -> AssetPullResult:
    """Materialise at ``dest`` the ``kind`` asset of ``model_ref`` built for this environment (or the
    one described by ``fingerprint``, e.g. computed on the GPU node by ``modelpack assets
    fingerprint``). Returns state none/hit/refused; raises ``AssetRefused`` instead when
    ``require_hit``. ``policy``: a TrustPolicy, RepositoryPolicy or trusted keys whose signature
    an asset must carry; None refuses every asset unless ``allow_unsigned`` (then nothing is
    checked). ``max_bytes`` caps what the asset's files may write (besides its record and the
    free space). ``cache``: a node cache (or its root) that keeps the asset next to the node's
    model snapshots; ``dest`` then gets a writable copy."""
    get_kind(kind)
    ref = parse_reference(model_ref) if isinstance(model_ref, str) else model_ref
    _check_destination(os.path.abspath(os.fspath(dest)))  # before any network
    target = open_readable(ref, target_options)
    model = target.resolve(ref.identifier)
    if fingerprint is not None:
        running = load_fingerprint(fingerprint)
    else:
        running = running_fingerprint(
            target, model, device=device, tp_size=tp_size, dtype=dtype, quantization=quantization
        )
    pinned = dataclasses.replace(ref, digest=model.digest)
    return pull_asset_from(
        target,
        pinned,
        model,
        dest,
        kind,
        running,
        policy=policy,
        allow_unsigned=allow_unsigned,
        max_bytes=max_bytes,
        events=events,
        start_id=start_id,
        require_hit=require_hit,
        cache=NodeCache(cache) if isinstance(cache, str) else cache,
    )
