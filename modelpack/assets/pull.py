"""Materialising the runtime asset built for exactly this environment, or starting cold.

Order of checks, each a reason to refuse with an event and leave nothing behind: the fingerprint
must match field for field (a near miss names the differing fields); the asset's signature must
satisfy the trust policy that governs the model's repository; the layer must hash to its digest
and unpack safely into a temp directory beside the destination. Only then is that directory
renamed into place, with a marker naming the asset, in one step. A refusal is not an error: the
engine compiles from scratch, as it would have without modelpack.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from modelpack.assets.archive import unpack_layer
from modelpack.assets.environment import running_fingerprint
from modelpack.assets.fingerprint import EnvironmentFingerprint, describe
from modelpack.assets.kinds import MARKER_FILE, get_kind
from modelpack.assets.push import FingerprintSource, load_fingerprint
from modelpack.assets.stored import StoredAsset, list_assets, select
from modelpack.errors import (
    AssetError,
    AssetRefused,
    DigestMismatchError,
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
from modelpack.signing.policy import RepositoryPolicy
from modelpack.signing.verify import PolicyOrKeys, resolve_policy, verify_artifact
from modelpack.targets.base import ReadableTarget
from modelpack.targets.opener import TargetOptions, open_readable

STATES = ("hit", "none", "refused")
START_ID_ENV = "MODELPACK_START_ID"  # one start's id across processes (init container → engine)


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
    signature: str = "not checked"  # verified | unsigned | not checked
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


def read_marker(path: str) -> dict[str, Any] | None:
    """The marker a pull left in ``path``, or None (absent, or not ours)."""
    try:
        with open(os.path.join(path, MARKER_FILE), "rb") as f:
            doc = json.loads(f.read(64 * 1024))
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and isinstance(doc.get("asset"), str) else None


def _check_destination(dest: str) -> dict[str, Any] | None:
    """Refuse to overwrite what we did not write: ``dest`` is absent, empty, or an earlier pull's."""
    if not os.path.lexists(dest):
        return None
    if os.path.islink(dest) or not os.path.isdir(dest):
        raise AssetError(f"{dest}: exists and is not a directory; refusing to replace it")
    marker = read_marker(dest)
    if marker is None and os.listdir(dest):
        raise AssetError(
            f"{dest}: not empty and not an asset modelpack materialised; pull into a new directory "
            "(the runtime then reads it through its cache variable)"
        )
    return marker


class _Refusal(Exception):
    def __init__(self, reason: str, signature: str = "not checked") -> None:
        super().__init__(reason)
        self.reason = reason
        self.signature = signature


def _asset_policy(policy: PolicyOrKeys, model_ref: Reference) -> RepositoryPolicy:
    """The model repository's rule, for an asset: same keys, same "signature required"; the
    directory-signature and chunk-table requirements describe weights, not caches."""
    rp = resolve_policy(policy, model_ref)
    return dataclasses.replace(rp, require_directory_signature=False, require_chunk_table=False)


def _verify_signature(
    target: ReadableTarget, ref: Reference, asset: StoredAsset, policy: PolicyOrKeys | None, events: EventLog
) -> str:
    if policy is None:
        return "not checked"
    asset_ref = dataclasses.replace(ref, tag=None, digest=asset.descriptor.digest)
    try:
        res = verify_artifact(target, asset_ref, asset.descriptor, _asset_policy(policy, ref), events=events)
    except SignatureRefused as exc:
        raise _Refusal(f"signature: {exc.reason}", "refused") from exc
    return res.status


Fill = Callable[[str], tuple[int, int]]


def _from_target(target: ReadableTarget, asset: StoredAsset) -> Fill:
    """Download the layer and unpack it into the temp directory, digest-checked as it streams."""

    def fill(tmp: str) -> tuple[int, int]:
        layer = asset.layer
        where = f"{target.name} asset {asset.digest} layer {layer.digest}"
        try:
            with contextlib.closing(target.fetch_blob(layer)) as stream:
                files = unpack_layer(
                    stream, str(layer.digest), layer.size, layer.media_type, tmp, where=where
                )
        except (DigestMismatchError, SizeMismatchError, UnsafeTarError) as exc:
            raise _Refusal(f"content: {exc}") from exc
        return len(files), sum(size for _, size, _ in files)

    return fill


def _from_cache(
    cache: NodeCache,
    target: ReadableTarget,
    ref: Reference,
    asset: StoredAsset,
    policy: PolicyOrKeys | None,
    start_id: str | None,
    outcome: dict[str, str],
) -> Fill:
    """Pull the asset into the node cache (one download per node, verified and signature-checked
    there, GC'd with the models), then link a writable view of it into the temp directory."""

    def fill(tmp: str) -> tuple[int, int]:
        asset_ref = dataclasses.replace(ref, tag=None, digest=asset.descriptor.digest)
        try:
            res = cache.pull(
                asset_ref,
                policy=_asset_policy(policy, ref) if policy is not None else None,
                source=target,
                # its own start: the asset's cold/hit must not read as the model's in a timeline
                start_id=f"{start_id}.assets" if start_id else uuid.uuid4().hex[:16],
            )
        except SignatureRefused as exc:
            raise _Refusal(f"signature: {exc.reason}", "refused") from exc
        except (DigestMismatchError, SizeMismatchError, UnsafeTarError) as exc:
            raise _Refusal(f"content: {exc}") from exc
        outcome["signature"] = res.signature.replace("-", " ")
        outcome["cache"] = res.state
        return writable_view(cache.snapshots, str(res.digest), tmp)

    return fill


def _materialise(fill: Fill, asset: StoredAsset, dest: str, model: Descriptor) -> tuple[int, int]:
    """Fill a temp directory beside ``dest``, check it against the record, rename it into place."""
    assert asset.record is not None
    parent = os.path.dirname(dest) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=TEMP_PREFIX, dir=parent)
    try:
        n, size = fill(tmp)
        if (n, size) != (asset.record.files, asset.record.size):
            raise _Refusal(
                f"content: {n} files / {size} bytes unpacked, the record says "
                f"{asset.record.files} / {asset.record.size}"
            )
        marker = {
            "asset": asset.digest,
            "model": str(model.digest),
            "kind": asset.record.kind,
            "fingerprintDigest": asset.record.fingerprint.digest,
            "files": n,
            "bytes": size,
        }
        with open(os.path.join(tmp, MARKER_FILE), "w", encoding="utf-8") as f:
            json.dump(marker, f, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o755)
        fsync_dir(tmp)
        if read_marker(dest) is not None:  # an earlier asset: swap, then drop the old one
            old = tempfile.mkdtemp(prefix=TEMP_PREFIX, dir=parent)
            os.rename(dest, os.path.join(old, "old"))
            os.rename(tmp, dest)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, dest)  # replaces an empty directory in one step
        fsync_dir(parent)
        return n, size
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def pull_asset_from(
    target: ReadableTarget,
    ref: Reference,
    model: Descriptor,
    dest: str | os.PathLike[str],
    kind: str,
    running: EnvironmentFingerprint,
    *,
    policy: PolicyOrKeys | None = None,
    events: EventLog | None = None,
    start_id: str | None = None,
    require_hit: bool = False,
    cache: NodeCache | None = None,
) -> AssetPullResult:
    """The core of ``pull_asset`` for a model already resolved (the loader integration's entry)."""
    t0 = time.monotonic()
    events = events or NullEventLog()
    start_id = start_id or os.environ.get(START_ID_ENV) or None
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
            if existing is not None and existing.get("asset") == asset.digest:
                result.signature = _verify_signature(target, ref, asset, policy, events)
                result.present = True
                result.files, result.bytes = int(existing.get("files", 0)), int(existing.get("bytes", 0))
            elif cache is None:
                result.signature = _verify_signature(target, ref, asset, policy, events)
                result.files, result.bytes = _materialise(_from_target(target, asset), asset, path, model)
            else:
                fill = _from_cache(cache, target, ref, asset, policy, start_id, outcome)
                result.files, result.bytes = _materialise(fill, asset, path, model)
                result.signature = outcome.get("signature", result.signature)
        except _Refusal as exc:
            result.reason = exc.reason
            result.signature = exc.signature if exc.signature != "not checked" else result.signature
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
    target_options: TargetOptions | None = None,
    events: EventLog | None = None,
    start_id: str | None = None,
    require_hit: bool = False,
    cache: NodeCache | str | None = None,
) -> AssetPullResult:
    """Materialise at ``dest`` the ``kind`` asset of ``model_ref`` built for this environment (or the
    one described by ``fingerprint``, e.g. computed on the GPU node by ``modelpack assets
    fingerprint``). Returns state none/hit/refused; raises ``AssetRefused`` instead when
    ``require_hit``. ``policy``: a TrustPolicy, RepositoryPolicy or trusted keys; None skips
    signature checks (as ``pull`` without ``--policy``). ``cache``: a node cache (or its root)
    that keeps the asset next to the node's model snapshots; ``dest`` then gets a writable view."""
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
        events=events,
        start_id=start_id,
        require_hit=require_hit,
        cache=NodeCache(cache) if isinstance(cache, str) else cache,
    )
