"""Runtime assets for vLLM starts: fetch the matching compile cache before vLLM compiles, time t6.

With ``"assets"`` in the extra config, each rank runs ``fetch_compile_cache`` after its weights
landed (``load_model`` has returned; vLLM compiles in the warm-up / profile run that follows):

1. the fingerprint of this load — the loader's plan (every rank's layout, re-planned with the
   rules the load used), the weights' digest and dtypes, vLLM's dtype and quantization, TP size,
   this machine's device and software versions — is computed and written to
   ``$VLLM_CACHE_ROOT/modelpack-fingerprint.json`` (what ``modelpack assets push --fingerprint``
   publishes a cold start's cache under);
2. under a lock shared by the node's ranks, the exact-match ``vllm`` asset is materialised at
   ``$VLLM_CACHE_ROOT/torch_compile_cache`` — the directory vLLM 0.32 reads its compile cache
   from: ``torch_aot_compile/<hash>/`` (AOT artifacts, ``rank_<i>_<j>/model``, and the
   ``inductor_cache/`` vLLM points Inductor at) and ``<hash>/rank_<i>_<j>/`` (piecewise graphs).
   vLLM's own hash over its config, environment and code still picks the entry inside, so a
   config the fingerprint does not name (max_model_len, compile sizes) misses and compiles;
3. the asset must be signed by a key the operator trusts: ``assets.policy`` /
   ``assets.trusted_keys``, else the weights' ``policy``, else their ``trusted_keys``; with none
   of them every asset is refused (state ``refused``) unless ``assets.allow_unsigned``;
4. a miss or a refusal never fails the start: the event names why (and the differing fields),
   an earlier materialised asset that no longer matches is removed, and vLLM compiles cold. A
   directory vLLM filled itself (a restart on a node with a persistent cache root) is used as
   it is and never replaced: state ``none`` with ``local_cache: true``. The one exception fails
   the start (``ServingError``): a compile-cache directory another user could have written
   (``modelpack.assets.destination``) — vLLM would load code from it whatever modelpack did;
5. the first forward pass of the model (where vLLM compiles, then runs one warm-up step) is
   timed as t6 with the asset state (``assets.compile_start`` / ``assets.compile_done``).

Kept free of vLLM imports: ``vllm_loader.py`` passes in what vLLM decided (cache root, dtype,
quantization, whether it compiles).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from modelpack.assets import destination
from modelpack.assets.environment import fingerprint_from_plan
from modelpack.assets.startup import compile_stage, fetch_before_compile
from modelpack.errors import AssetError, ModelpackError, ServingError

if TYPE_CHECKING:
    from torch import nn

    from modelpack.serving.weights import RankLoad

COMPILE_CACHE_DIR = "torch_compile_cache"  # under $VLLM_CACHE_ROOT (vllm/compilation/*.py)
FINGERPRINT_FILE = "modelpack-fingerprint.json"
LOCK_FILE = ".modelpack-assets.lock"
LOCK_WAIT_SECONDS = 600.0


@dataclass
class CompileCache:
    """What one rank decided before vLLM compiles."""

    state: str  # hit | none | refused
    path: str
    reason: str = ""
    asset: str | None = None
    fingerprint_file: str | None = None


def compile_cache_dir(cache_root: str) -> str:
    return os.path.join(cache_root, COMPILE_CACHE_DIR)


@contextlib.contextmanager
def _node_lock(path: str, timeout: float = LOCK_WAIT_SECONDS) -> Iterator[None]:
    """One rank of the node fetches; the others wait, then find the asset in place."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{path}: another rank held the asset lock for {timeout:.0f} s"
                    ) from None
                time.sleep(0.1)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _policy(rank: RankLoad) -> Any:
    """The asset's trust: its own policy/keys, else the model's policy, else the model's keys;
    None when there is none (then every asset is refused unless ``assets.allow_unsigned``)."""
    from modelpack.signing.keys import load_public_key
    from modelpack.signing.policy import TrustPolicy

    s = rank.settings
    a = s.assets
    assert a is not None
    if a.policy:
        return TrustPolicy.load(a.policy)
    if a.trusted_keys is not None:
        return [load_public_key(k) for k in a.trusted_keys] or None
    if s.policy:
        return TrustPolicy.load(s.policy)
    return list(rank._keys) or None


def fetch_compile_cache(
    rank: RankLoad,
    *,
    cache_root: str,
    device: Any,
    dtype: str | None,
    quantization: str | None,
) -> CompileCache:
    """Materialise this load's ``vllm`` asset where vLLM reads its compile cache (see the module
    docstring). Never raises for a registry, trust, fingerprint or file-system problem; raises
    ``ServingError`` when the compile-cache directory is one another user could have written."""
    s = rank.settings
    assert s.assets is not None
    events, start_id, kind = rank.events, rank.start_id, s.assets.kind
    dest = compile_cache_dir(cache_root)
    reference = s.assets_reference or ""

    def emit(state: str, reason: str, **extra: object) -> None:
        events.emit(
            f"assets.{state}",
            start_id=start_id,
            tp_rank=rank.tp_rank,
            reference=reference,
            digest=rank.stats.digest,
            kind=kind,
            asset_state=state,
            reason=reason[:2000],
            **extra,
        )

    def refused(reason: str) -> CompileCache:
        emit("refused", reason)
        return CompileCache("refused", dest, reason)

    plan, load_fp = rank.stats.plan, rank.stats.fingerprint
    if plan is None or load_fp is None:
        return refused("the load recorded no plan or fingerprint; nothing to match an asset against")
    try:
        running = fingerprint_from_plan(
            plan,
            load_fp,
            device=device,
            rules=rank.rules,
            presets=False,
            dtype=dtype,
            quantization=quantization,
        )
        os.makedirs(cache_root, exist_ok=True)
        fp_file = os.path.join(cache_root, FINGERPRINT_FILE)
        running.write(fp_file)
        policy = _policy(rank)
    except (ModelpackError, OSError, ValueError) as exc:
        return refused(f"{type(exc).__name__}: {exc}")
    foreign: AssetError | None = None
    try:
        with _node_lock(os.path.join(cache_root, LOCK_FILE)):
            try:
                here = destination.inspect(dest)
            except AssetError as exc:
                foreign = exc
                raise
            if not here.empty and here.marker is None:
                reason = (
                    f"{dest} already holds vLLM's own compile cache (compiled on this node); used as it is"
                )
                emit("none", reason, local_cache=True)
                return CompileCache("none", dest, reason, fingerprint_file=fp_file)
            res = fetch_before_compile(
                reference,
                dest,
                kind,
                fingerprint=running,
                policy=policy,
                allow_unsigned=s.assets.allow_unsigned,
                target_options=s.target_options(),
                events=events,
                start_id=start_id,
                apply_environment=False,
            )
            if res.state != "hit" and destination.read_marker(dest) is not None:
                # an asset an earlier start materialised, no longer this load's: compile cold
                shutil.rmtree(dest)
    except (ModelpackError, OSError) as exc:
        if foreign is None:
            return refused(f"{type(exc).__name__}: {exc}")
    if foreign is not None:
        refused(f"{type(foreign).__name__}: {foreign}")
        raise ServingError(
            f"{dest}: vLLM would load compiled code from this directory, and another user could "
            f"have written it ({foreign}); use a VLLM_CACHE_ROOT only this user can write"
        ) from foreign
    return CompileCache(res.state, dest, res.reason, res.asset, fp_file)


def time_first_forward(model: nn.Module, rank: RankLoad, asset_state: str) -> None:
    """t6: the model's first forward pass after loading — vLLM's compile (from the fetched cache
    on a hit), then one warm-up step (``assets.compile_failed`` if it raises). Hooks remove
    themselves after that call."""
    stack = contextlib.ExitStack()
    handles: list[Any] = []

    def before(_module: Any, _args: Any) -> None:
        stack.enter_context(
            compile_stage(
                rank.events,
                asset_state=asset_state,
                start_id=rank.start_id,
                digest=rank.stats.digest,
                kind="vllm",
                tp_rank=rank.tp_rank,
            )
        )

    def after(_module: Any, _args: Any, _output: Any) -> None:
        for h in handles:
            h.remove()
        failure = sys.exc_info()  # set when torch runs this hook because the forward raised
        if failure[1] is None:
            stack.close()
            return
        try:  # compile_stage writes assets.compile_failed, then re-raises: torch raises it anyway
            stack.__exit__(*failure)
        except BaseException:  # the forward's own exception is already propagating
            pass

    handles.append(model.register_forward_pre_hook(before))
    handles.append(model.register_forward_hook(after, always_call=True))
