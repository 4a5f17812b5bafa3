"""The engine-side hook: fetch a matching compile cache before compiling, and time the compile (t6).

An engine (the vLLM integration, or any code that calls ``torch.compile``) calls
``fetch_before_compile`` once per start, after the weights are resolved and before the first
compile, then wraps the compile in ``compile_stage``. The fetch never fails a start: any refusal or
error becomes state ``refused`` (with its reason and an event) and the engine compiles cold, as it
would have without modelpack. The t6 event carries that state, so ``modelpack timeline`` can
compare compile times of starts with and without a shipped cache.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from modelpack.assets.environment import fingerprint_from_prepared, running_fingerprint
from modelpack.assets.fingerprint import EnvironmentFingerprint
from modelpack.assets.pull import AssetPullResult, pull_asset_from
from modelpack.assets.push import FingerprintSource, load_fingerprint
from modelpack.errors import ModelpackError
from modelpack.events import EventLog, NullEventLog
from modelpack.mount import NodeCache
from modelpack.oci.reference import Reference, parse_reference
from modelpack.settings import resolve_start_id
from modelpack.signing.verify import PolicyOrKeys
from modelpack.targets.opener import TargetOptions, open_readable

if TYPE_CHECKING:
    from modelpack.loader import PreparedLoad
    from modelpack.loader.plan import RulesLike


def fetch_before_compile(
    model_ref: str | Reference,
    dest: str | os.PathLike[str],
    kind: str = "inductor",
    *,
    prepared: PreparedLoad | None = None,
    fingerprint: FingerprintSource | None = None,
    device: Any = "cpu",
    tp_size: int = 1,
    rules: RulesLike = None,
    presets: bool = True,
    uneven: str = "refuse",
    dtype: str | None = None,
    quantization: str | None = None,
    policy: PolicyOrKeys | None = None,
    allow_unsigned: bool = False,
    max_bytes: int | None = None,
    target_options: TargetOptions | None = None,
    events: EventLog | None = None,
    start_id: str | None = None,
    apply_environment: bool = True,
    cache: NodeCache | str | None = None,
) -> AssetPullResult:
    """Materialise the ``kind`` asset of ``model_ref`` that matches this start at ``dest``.

    The fingerprint comes from ``fingerprint``, else from ``prepared`` (the loader's prepared load
    of this rank: no header is read twice), else from the model's headers. On a hit with
    ``apply_environment`` the kind's variable (``TORCHINDUCTOR_CACHE_DIR`` …) is set in this
    process so the compile that follows reads the cache. Never raises for a registry, trust or
    fingerprint problem: those come back as state ``refused``; without ``policy`` every asset is
    refused (an asset is code) unless ``allow_unsigned``. With ``cache`` (a node cache or its
    root) the asset is kept next to the node's model snapshots and ``dest`` is a writable copy.
    """
    events = events or NullEventLog()
    start_id = resolve_start_id(start_id)
    t0 = time.monotonic()
    ref = parse_reference(model_ref) if isinstance(model_ref, str) else model_ref
    running: EnvironmentFingerprint | None = None
    digest = str(ref.digest or "")
    try:
        target = open_readable(ref, target_options)
        model = target.resolve(ref.identifier)
        digest = str(model.digest)
        if fingerprint is not None:
            running = load_fingerprint(fingerprint)
        elif prepared is not None:
            running = fingerprint_from_prepared(
                prepared,
                device=device,
                rules=rules,
                presets=presets,
                uneven=uneven,
                dtype=dtype,
                quantization=quantization,
            )
        else:
            running = running_fingerprint(
                target,
                model,
                device=device,
                tp_size=tp_size,
                rules=rules,
                presets=presets,
                uneven=uneven,
                dtype=dtype,
                quantization=quantization,
            )
        result = pull_asset_from(
            target,
            dataclasses.replace(ref, digest=model.digest),
            model,
            dest,
            kind,
            running,
            policy=policy,
            allow_unsigned=allow_unsigned,
            max_bytes=max_bytes,
            events=events,
            start_id=start_id,
            cache=NodeCache(cache) if isinstance(cache, str) else cache,
        )
    except ModelpackError as exc:
        reason = f"{type(exc).__name__}: {exc}"
        events.emit(
            "assets.refused",
            reference=str(ref),
            digest=digest or None,
            kind=kind,
            asset_state="refused",
            reason=reason,
            start_id=start_id,
        )
        empty = running or EnvironmentFingerprint.from_dict({})
        result = AssetPullResult("refused", str(ref), digest, kind, empty, reason=reason)
        result.duration_ms = (time.monotonic() - t0) * 1000.0
        return result
    if apply_environment:
        os.environ.update(result.environment())
    return result


def _inductor_counters() -> dict[str, int]:
    """Inductor's own cache counters, when torch.compile has been imported (never imports it)."""
    utils = sys.modules.get("torch._dynamo.utils")
    counters = getattr(utils, "counters", None) if utils is not None else None
    if counters is None:
        return {}
    inductor = counters.get("inductor", {})
    out = {k: int(v) for k, v in inductor.items() if k.startswith("fxgraph_cache")}
    # AOTAutograd's cache sits in front of the FX graph cache (a hit there skips Inductor)
    out.update(
        {k: int(v) for k, v in counters.get("aot_autograd", {}).items() if k.startswith("autograd_cache")}
    )
    return out


@contextlib.contextmanager
def compile_stage(
    events: EventLog | None,
    *,
    asset_state: str,
    start_id: str | None = None,
    digest: str | None = None,
    kind: str = "inductor",
    **fields: Any,
) -> Iterator[dict[str, Any]]:
    """Time the block as t6 (compile done); the event carries ``asset_state`` and, for Inductor,
    how many FX graphs came from the cache. The yielded dict receives ``duration_ms`` afterwards;
    ``fields`` (``tp_rank`` …) go into every event."""
    events = events or NullEventLog()
    start_id = resolve_start_id(start_id)
    before = _inductor_counters()
    info: dict[str, Any] = {}
    events.emit(
        "assets.compile_start", start_id=start_id, digest=digest, kind=kind, asset_state=asset_state, **fields
    )
    t0 = time.monotonic()
    try:
        yield info
    except BaseException as exc:
        events.emit(
            "assets.compile_failed",
            start_id=start_id,
            digest=digest,
            kind=kind,
            asset_state=asset_state,
            reason=f"{type(exc).__name__}: {exc}",
            duration_ms=round((time.monotonic() - t0) * 1000.0, 3),
            **fields,
        )
        raise
    info["duration_ms"] = (time.monotonic() - t0) * 1000.0
    after = _inductor_counters()
    delta = {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}
    info["counters"] = delta
    events.emit(
        "assets.compile_done",
        stage="t6",
        start_id=start_id,
        digest=digest,
        kind=kind,
        asset_state=asset_state,
        duration_ms=round(info["duration_ms"], 3),
        inductor=delta or None,
        **fields,
    )
