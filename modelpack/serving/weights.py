"""One vLLM rank's weights through modelpack: resolve and check the source, then stream full-shape tensors.

Kept free of vLLM imports (``vllm_loader.py`` is the thin vLLM class around it) so the checks —
pinning, signature policy, the model directory, the read plan — run and are tested without vLLM.

Order matters for "refused before serving": everything that can refuse (extra-config keys, the
pin, the policy, the model directory, the fingerprint, the manifest digest) runs before the first
weight byte is read, and each refusal is written to the event log before it is raised; vLLM then
fails its start instead of serving.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from modelpack import settings as env_settings
from modelpack.errors import ModelpackError, ServingConfigError, SettingsError
from modelpack.events import EventLog, NullEventLog
from modelpack.loader import CacheStream, LoaderOptions, LoadRequest, LoadStats, ReadPlan, iter_tensors
from modelpack.loader.experts import NUM_EXPERTS_KEYS, ExpertLayout
from modelpack.mount.resolve import resolve_trusted
from modelpack.oci.reference import parse_reference
from modelpack.serving.full_shape import iter_full_shape
from modelpack.serving.model_dir import check_model_dir, check_snapshot_dir
from modelpack.serving.param_destinations import ParameterDestinations
from modelpack.serving.settings import ServingSettings
from modelpack.serving.shard_rules import vllm_shard_rules


@dataclass(frozen=True)
class EngineExperts:
    """How vLLM spreads a mixture-of-experts model's routed experts over its ranks, as its parallel
    config says (``vllm_loader.py`` reads it; kept here so the mapping is tested without vLLM)."""

    enabled: bool = False  # --enable-expert-parallel
    ep_size: int = 1  # vLLM's EP group: TP × DP ranks
    ep_rank: int = 0
    placement: str = "linear"  # --expert-placement-strategy
    eplb: bool = False  # --enable-eplb: redundant experts that move between ranks at run time
    # data-parallel × context-parallel engine replicas: without EP, vLLM splits each expert over
    # all of their ranks (replicas × TP), not over the TP ranks the TP rules know
    replicas: int = 1


#: vLLM's expert placement strategies, which the loader's expert maps of the same name reproduce
VLLM_EXPERT_PLACEMENTS = ("linear", "round_robin")
# a routed expert's tensors (per-expert or stacked), as the loader's expert presets name them
_ROUTED_EXPERTS = r"(^|\.)experts\."


def vllm_expert_layout(
    experts: EngineExperts | None,
) -> tuple[ExpertLayout | None, list[tuple[str, str]], str]:
    """(the loader's expert layout or None, rules to put before the TP rules, why) for vLLM's EP.

    Without expert parallelism vLLM splits every expert over the TP ranks like a dense MLP, which
    the TP rules describe: no layout. With it, a rank holds whole experts, those vLLM's placement
    gives its EP rank. With expert load balancing (EPLB) the experts a rank holds change at run
    time, so every rank reads every routed expert whole (and no TP rule may split one).
    """
    if experts is None:
        return None, [], ""
    if not experts.enabled or experts.ep_size <= 1:
        if experts.replicas > 1:
            return (
                None,
                [(_ROUTED_EXPERTS, "replicate")],
                (
                    f"vLLM splits each expert over {experts.replicas} data/context-parallel replicas × TP: "
                    "routed experts read whole"
                ),
            )
        return None, [], ""
    if experts.eplb:
        return (
            None,
            [(_ROUTED_EXPERTS, "replicate")],
            ("expert load balancing moves experts between ranks: every routed expert read whole"),
        )
    if experts.placement not in VLLM_EXPERT_PLACEMENTS:
        raise ServingConfigError(
            f"vLLM's expert placement {experts.placement!r} is not one modelpack reproduces "
            f"{VLLM_EXPERT_PLACEMENTS}: a guessed map would load other experts' weights"
        )
    layout = ExpertLayout(experts.ep_size, experts.ep_rank, experts.placement)
    return layout, [], f"expert parallel {experts.ep_size}, rank {experts.ep_rank}, {experts.placement}"


def declares_experts(hf_config: object) -> bool:
    """Whether the model's config names a number of routed experts (a mixture-of-experts model)."""
    cfg = hf_config if isinstance(hf_config, Mapping) else getattr(hf_config, "__dict__", {})
    for where in (cfg, cfg.get("text_config")):
        where = where if isinstance(where, Mapping) else getattr(where, "__dict__", None)
        if isinstance(where, Mapping) and any(
            isinstance(where.get(k), int) and where.get(k, 0) > 0 for k in NUM_EXPERTS_KEYS
        ):
            return True
    return False


@dataclass
class RankLoad:
    """What one rank is about to read; ``tensors()`` streams it, ``stats`` fills in as it goes."""

    settings: ServingSettings
    model_dir: str
    tp_size: int
    tp_rank: int
    events: EventLog
    start_id: str
    source: Any
    state: str
    rules: list[tuple[str, str]]
    rules_reason: str
    stats: LoadStats = field(default_factory=LoadStats)
    plan: ReadPlan | None = None
    # the engine's TP process group (vLLM's gloo cpu_group): ranks share chunk-verified reads
    group: Any = None
    _keys: list[Any] = field(default_factory=list)
    # a source pinning an index of variants: the selector the loader picks the entry with
    variant: Any = None
    # tensors read straight into the engine's parameters (param_destinations.py), and why not all
    direct: ParameterDestinations | None = None
    # vLLM's expert parallelism: this rank reads only the routed experts the map gives it, whole
    experts: ExpertLayout | None = None

    def tensors(self, model: torch.nn.Module | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Checkpoint-named, checkpoint-shaped CPU tensors; only this rank's slices hold data.

        With ``model`` (unquantized, its ``load_weights`` about to consume these), whole tensors
        that would be read into fresh memory are read straight into the parameter regions the
        model's own ``load_weights`` copies them to, found by a dry run on the plan. That dry run
        runs here, with the plan and the first tensor, so not inside the real ``load_weights``.
        """
        it = self._tensors(model)
        if model is None:
            return it
        first = next(it, None)
        return itertools.chain([] if first is None else [first], it)

    def _tensors(self, model: torch.nn.Module | None) -> Iterator[tuple[str, torch.Tensor]]:

        def on_plan(plan: ReadPlan) -> None:
            self.plan = plan

        def into(plan: ReadPlan) -> dict[str, torch.Tensor]:
            assert model is not None
            self.direct = ParameterDestinations.trace(model, plan)
            if self.direct.reason:
                self.events.emit(
                    "serving.copy_path",
                    start_id=self.start_id,
                    tp_rank=self.tp_rank,
                    tensors=len(plan.tensors) - len(self.direct.tensors),
                    reason=self.direct.reason,
                )
            return self.direct.tensors

        s = self.settings
        sharded = s.layout == "sharded_state"
        ep = self.experts if self.experts is not None and not sharded else ExpertLayout()
        request = LoadRequest(
            tp_size=self.tp_size,
            tp_rank=self.tp_rank,
            rules=self.rules,
            presets=False,
            ep_size=ep.ep_size,
            ep_rank=ep.ep_rank,
            expert_map=ep.expert_map,
            layout=s.layout,
            expected_digest=None if s.trust == "runtime" else s.pinned_digest,
            fingerprint=s.fingerprint,
            trusted_keys=self._keys or None,
            allow_unverified=s.trust == "runtime",
            events=self.events,
            start_id=self.start_id,
            state=self.state,
            stats=self.stats,
            on_plan=on_plan,
            # store blobs trusted by inode go to vLLM as views of the mapped file (one copy: vLLM's);
            # the TP ranks share chunk-verified reads over the engine's group
            options=LoaderOptions(views="full", group=None if sharded else self.group, variant=self.variant),
        )
        if sharded:  # this rank's own files, whole: vLLM's parameter names and per-rank shapes
            yield from iter_tensors(self.source, request)
            return
        # a hit hands vLLM views of the mapped blobs (one copy, vLLM's): nothing to place
        direct = model is not None and self.state != "hit" and self.settings.into_parameters
        # straight into the parameters: the load runs on their device (a GPU: pinned slot →
        # parameter region through the loader's device seam, one pass)
        device = _parameter_device(model) if direct and model is not None else torch.device("cpu")
        yield from iter_full_shape(self.source, request, into=into if direct else None, device=device)

    def summary(self) -> dict[str, Any]:
        """Per-rank bytes for the ``serving.weights_loaded`` event (and the TP test)."""
        plan = self.plan
        return {
            "start_id": self.start_id,
            "state": self.stats.state or self.state,
            "digest": self.stats.digest,
            "tp_size": self.tp_size,
            "tp_rank": self.tp_rank,
            "layout": self.settings.layout,
            "files": sorted(plan.files) if plan else None,
            "bytes_read": self.stats.bytes_read,
            "bytes_to_read": self.stats.bytes_to_read,
            "bytes_received": self.stats.bytes_received,
            "model_bytes": plan.total_bytes if plan else None,
            "replicated_bytes": plan.replicated_bytes if plan else None,
            "ep_size": plan.ep_size if plan else 1,
            "ep_rank": plan.ep_rank if plan else 0,
            "experts": list(plan.experts) if plan and plan.ep_size > 1 else None,
            "tensors": self.stats.tensors,
            # bytes read straight into the engine's parameters (no fresh tensor, no second copy)
            "direct_tensors": len(self.direct.tensors) if self.direct else 0,
            "direct_bytes": self.direct.nbytes if self.direct else 0,
            "rules": self.rules_reason,
            "cache": self.source.report.to_json() if isinstance(self.source, CacheStream) else None,
            "duration_ms": round(self.stats.seconds * 1000, 3),
        }


def process_start_time(pid: int | None = None) -> float:
    """Unix time the process started (Linux /proc), or now where that cannot be read."""
    try:
        with open(f"/proc/{pid or os.getpid()}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        ticks = int(fields[19])  # field 22 (starttime), counted after the ")" that ends comm
        with open("/proc/stat") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, StopIteration, IndexError):
        return time.time()


def start_time(environ: Mapping[str, str] | None = None) -> float:
    """t0 of this start: ``$MODELPACK_T0`` (pod creation, or the first vLLM process), else now."""
    try:
        t0 = env_settings.T0.get(environ)
    except SettingsError:
        t0 = None  # a bad t0 only skews the timeline: never refuse a start for it
    return time.time() if t0 is None else t0


def open_rank_load(
    extra_config: Mapping[str, Any] | None,
    model_dir: str,
    hf_config: Any,
    tp_size: int,
    tp_rank: int,
    *,
    environ: Mapping[str, str] | None = None,
    target_factory: Callable[[Any, Any], Any] | None = None,
    experts: EngineExperts | None = None,
) -> RankLoad:
    """Check everything that can refuse this start, then return the rank's load (nothing read yet).

    Writes t0 (``serving.start``) first, so even a refused start shows in ``modelpack timeline``.
    ``experts``: vLLM's expert parallelism, when the engine uses it.
    """
    env = os.environ if environ is None else environ
    events: EventLog = NullEventLog()
    start_id = env_settings.resolve_start_id(None, env)  # the settings may name another
    try:
        settings = ServingSettings.from_extra_config(extra_config, env)
    except ModelpackError as exc:
        # no settings means no event path from them; $MODELPACK_EVENTS still records the refusal
        if refusal_log := env_settings.EVENTS.get(env):
            EventLog(refusal_log).emit(
                "serving.refused", start_id=start_id, tp_rank=tp_rank, reason=f"{type(exc).__name__}: {exc}"
            )
        raise
    if settings.events:
        events = EventLog(settings.events)
    start_id = settings.start_id or start_id
    events.emit(
        "serving.start",
        ts=start_time(env),
        stage="t0",
        start_id=start_id,
        engine="vllm",
        tp_size=tp_size,
        tp_rank=tp_rank,
        model=model_dir,
        reference=settings.source,
        digest=settings.pinned_digest,
    )
    try:
        return _resolve(
            settings, model_dir, hf_config, tp_size, tp_rank, events, start_id, target_factory, experts
        )
    except ModelpackError as exc:
        events.emit(
            "serving.refused",
            start_id=start_id,
            tp_rank=tp_rank,
            reference=settings.source or model_dir,
            digest=settings.pinned_digest,
            reason=f"{type(exc).__name__}: {exc}"[:2000],
        )
        raise


def _resolve(
    settings: ServingSettings,
    model_dir: str,
    hf_config: Any,
    tp_size: int,
    tp_rank: int,
    events: EventLog,
    start_id: str,
    target_factory: Callable[[Any, Any], Any] | None,
    experts: EngineExperts | None = None,
) -> RankLoad:
    keys: list[Any] = []
    if settings.trusted_keys:
        # only with keys: modelpack.signing pulls in cryptography's native bindings (~35 ms warm),
        # which a cache hit (no keys) would otherwise pay inside vLLM's timed load_model
        from modelpack.signing.keys import load_public_key

        keys = [load_public_key(k) for k in settings.trusted_keys]
    vllm_rules, reason = vllm_shard_rules(hf_config, tp_size)
    # vLLM ignores --enable-expert-parallel for a dense model, and so does the plan
    layout, expert_rules, expert_reason = vllm_expert_layout(experts if declares_experts(hf_config) else None)
    rules: list[tuple[str, str]] = list(settings.shard_rules.items()) + expert_rules
    rules += [(pattern, rule.value) for pattern, rule in vllm_rules]
    if expert_reason:
        reason = f"{reason}; {expert_reason}"
    if settings.shard_rules:
        reason = f"caller rules {sorted(settings.shard_rules)} first; " + reason
    if settings.layout == "sharded_state":
        reason = "sharded_state: each rank reads its own rank files whole"
    if settings.source is None:
        source: Any = model_dir
        state = "image-volume" if settings.trust == "runtime" else "hit"
        if settings.trust == "snapshot":
            check_snapshot_dir(model_dir, settings)  # again here: vllm_plugin checked it first
    else:
        # vLLM's own TP size and name select among variants ($MODELPACK_VARIANT, _ACCELERATOR)
        selector = settings.variant_selector(tp_size)
        source, state = _remote_source(settings, model_dir, keys, events, target_factory, selector)
    return RankLoad(
        settings,
        model_dir,
        tp_size,
        tp_rank,
        events,
        start_id,
        source,
        state,
        rules,
        reason,
        _keys=keys,
        variant=selector if settings.source is not None else None,
        experts=layout,
    )


def _remote_source(
    settings: ServingSettings,
    model_dir: str,
    keys: list[Any],
    events: EventLog,
    target_factory: Callable[[Any, Any], Any] | None,
    selector: Any = None,
) -> tuple[Any, str]:
    """(``(target, digest)`` for the loader, state): policy checked, model directory matched.
    A pin naming an index of variants: the index (policy: its signature) and the entry
    ``selector`` picks, whose manifest the model directory must match; the loader selects the
    same entry from the same pin (``LoaderOptions.variant``)."""
    from modelpack.errors import ExpectedDigestError
    from modelpack.targets.fetch import fetch_manifest
    from modelpack.targets.opener import open_readable

    assert settings.source is not None
    ref = parse_reference(settings.source)
    pinned = settings.pinned_digest
    assert pinned is not None  # settings refuse an unpinned source
    if ref.digest and str(ref.digest) != pinned:
        raise ExpectedDigestError(pinned, str(ref.digest), source=settings.source)
    options = settings.target_options()
    target = (target_factory or open_readable)(ref, options)
    policy = None
    if settings.policy:
        from modelpack.signing.policy import TrustPolicy

        policy = TrustPolicy.load(settings.policy)
    trusted = resolve_trusted(
        ref.with_digest(pinned), policy=policy, selector=selector, target=target, events=events
    )
    if trusted.variant is not None:
        events.emit("serving.variant_selected", **trusted.variant.to_json())
    pinned_entry = trusted.digest
    manifest, digest = fetch_manifest(target, pinned_entry)
    if digest != pinned_entry:  # pragma: no cover - fetch_manifest resolves by the pin itself
        raise ExpectedDigestError(pinned_entry, digest, source=settings.source)
    check_model_dir(
        model_dir, manifest, where=str(ref.with_digest(pinned_entry)), allow_extra=settings.allow_extra_files
    )
    if settings.cache:  # streamed through the node cache: the next start on this node is a hit
        from modelpack.mount.cache import NodeCache

        return (
            CacheStream(
                NodeCache(settings.cache),
                ref.with_digest(pinned),
                target_options=options,
                target=target,
                policy=policy if policy is not None else (keys or None),
                fill=settings.cache_fill,
                # the engine keeps running: its start does not wait for the cache's fsyncs and
                # publish (the summary says "publishing" until the fill ends)
                publish="background",
            ),
            "streamed",
        )
    # a tag named beside the pin is handed on: the loader refuses it if it moved off the pin
    return (target, ref.tag if ref.tag and not ref.digest else pinned), "streamed"


def _parameter_device(model: torch.nn.Module) -> torch.device:
    """The device of the model's parameters (CPU when it has none, or they are on ``meta``)."""
    p = next(iter(model.parameters()), None)
    return p.device if p is not None and not p.is_meta else torch.device("cpu")
