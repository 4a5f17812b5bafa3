"""The `modelpack` load format's settings: ``--model-loader-extra-config`` JSON, checked up front.

Every key is validated before any byte is read, so a typo refuses the start instead of silently
loading something else. Keys (all optional except that the weights must be pinned):

``source``            a reference to stream from, pinned by digest (``host/repo@sha256:…``,
                      ``s3://bucket/prefix@sha256:…``, ``oci:DIR@sha256:…``); absent: the weights
                      come from ``--model`` itself (a node-cache snapshot)
``expected_digest``   the manifest digest the weights must have (``sha256:…``); required for a
                      snapshot, optional when ``source`` carries ``@sha256:``
``trusted_keys``      PEM public-key paths whose signed chunk table verifies streamed chunks
``policy``            a trust-policy YAML checked against the source before anything is read
``fingerprint``       a recorded fingerprint (file path or ``sha256:`` digest) the load must match
``cache``             a node cache directory (as ``pull --cache``) to stream ``source`` through:
                      a hit reads the snapshot; a miss writes each verified blob into it while
                      the rank reads it and publishes the snapshot once every blob is committed,
                      so the next start on the node is a hit (docs/loader.md#stream-through-cache)
``cache_fill``        with ``cache``, for a rank that reads only its TP/EP share: ``leave`` (default;
                      the snapshot is left to a full fill) or ``background`` (the whole model is
                      filled, the rank reads its share from the cache as it lands)
``events``            JSON-lines event log (default: ``$MODELPACK_EVENTS``); t2–t5 and refusals
``start_id``          groups this start's events (default: ``$MODELPACK_START_ID``)

The registry connection (timeout, retry budget, mirrors) comes from the environment as for every
other entry point (``TargetOptions.from_environ``, docs/configuration.md); ``plain_http`` and
``ca_file`` below are this start's own.
``shard_rules``       ``{regex: replicate|dim0|dim1}`` tried before the vLLM-derived rules
``plain_http``, ``ca_file``   registry connection settings (loopback registries need neither)
``allow_extra_files`` ``true``: ``--model`` may hold files the pinned artifact does not list
                      (default false: such a file refuses the start before vLLM reads its config)
``into_parameters``   ``false``: read every tensor into fresh memory for vLLM to copy, instead of
                      (default true) reading whole tensors straight into the parameter memory a
                      dry run of the model's ``load_weights`` finds for them (param_destinations.py)
``trust``             ``snapshot`` (default) or ``runtime``: ``--model`` is an image volume whose
                      digest the container runtime verified (pinned in the pod spec); the loader
                      then reads it as a plain directory and records the pin only in its events
``layout``            ``canonical`` (default: whole checkpoint tensors, each rank reads its slice) or
                      ``sharded_state`` (vLLM's per-rank files: each rank reads only its own files,
                      whole, into vLLM's parameters); an artifact of the other layout, or a
                      sharded_state artifact split for another TP size, is refused before reading
``assets``            opt in to runtime assets (docs/assets.md): ``{}`` or an object with
                      ``kind`` (``vllm``, the only one vLLM reads), ``ref`` (where the model's
                      asset referrers live; default ``source``, required when the weights come
                      from ``--model``; pinned to the weights' digest when it names none),
                      ``policy`` / ``trusted_keys`` (who must have signed an asset; default the
                      model's ``policy``, else its ``trusted_keys``; with none of them every
                      asset is refused — an asset is code — unless ``allow_unsigned: true``).
                      Before vLLM compiles, each rank fetches the asset matching this load's
                      fingerprint into ``$VLLM_CACHE_ROOT/torch_compile_cache``; a miss or a
                      refusal never fails the start (vLLM compiles cold)
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from modelpack import settings as env_settings
from modelpack.errors import ServingConfigError
from modelpack.mediatypes.variants import LAYOUTS
from modelpack.oci.digest import Digest
from modelpack.oci.reference import parse_reference
from modelpack.oci.variant_selection import VariantSelector
from modelpack.targets.options import TargetOptions

_STR_KEYS = (
    "source",
    "expected_digest",
    "policy",
    "fingerprint",
    "events",
    "start_id",
    "ca_file",
    "trust",
    "layout",
    "cache",
    "cache_fill",
)
KNOWN_KEYS = frozenset(
    {
        *_STR_KEYS,
        "trusted_keys",
        "shard_rules",
        "plain_http",
        "assets",
        "allow_extra_files",
        "into_parameters",
    }
)
TRUST_MODES = ("snapshot", "runtime")
CACHE_FILL_MODES = ("leave", "background")
ASSET_KEYS = frozenset({"kind", "ref", "policy", "trusted_keys", "allow_unsigned"})
#: Asset kinds an engine start can fetch: the cache vLLM itself reads before it compiles.
ENGINE_ASSET_KINDS = ("vllm",)


@dataclass(frozen=True)
class AssetSettings:
    """``assets`` of the extra config: which compile cache to fetch before vLLM compiles, from where,
    and whose signature it needs (``None`` fields fall back to the model's settings)."""

    kind: str = "vllm"
    ref: str | None = None
    policy: str | None = None
    trusted_keys: tuple[str, ...] | None = None
    allow_unsigned: bool = False  # use an asset nobody signed (no policy or keys at all)


def _key_list(value: Any, what: str) -> list[str]:
    keys = [value] if isinstance(value, str) else value
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise ServingConfigError(f"--model-loader-extra-config: {what} must be a list of paths")
    return keys


def _asset_settings(doc: Any, source: str | None) -> AssetSettings:
    where = "--model-loader-extra-config: assets"
    if not isinstance(doc, dict):
        raise ServingConfigError(f'{where} must be an object, e.g. {{}} or {{"kind": "vllm"}}')
    unknown = sorted(set(doc) - ASSET_KEYS)
    if unknown:
        raise ServingConfigError(f"{where}: unknown key(s) {unknown}; known: {sorted(ASSET_KEYS)}")
    for key in ("kind", "ref", "policy"):
        if key in doc and not isinstance(doc[key], str):
            raise ServingConfigError(f"{where}.{key} must be a string")
    kind = doc.get("kind", "vllm")
    if kind not in ENGINE_ASSET_KINDS:
        raise ServingConfigError(
            f"{where}.kind {kind!r}: vLLM reads only {list(ENGINE_ASSET_KINDS)} before it compiles "
            "(pull other kinds with 'modelpack assets pull' and point the runtime at them)"
        )
    ref = doc.get("ref") or None
    if ref:
        try:
            parse_reference(ref)
        except ValueError as exc:
            raise ServingConfigError(f"{where}.ref {ref!r}: {exc}") from exc
    elif not source:
        raise ServingConfigError(
            f"{where}.ref is required when the weights come from --model: the registry reference "
            "whose referrers hold the model's assets (host/repo@sha256:…)"
        )
    if not isinstance(doc.get("allow_unsigned", False), bool):
        raise ServingConfigError(f"{where}.allow_unsigned must be true or false")
    keys = doc.get("trusted_keys")
    return AssetSettings(
        kind=kind,
        ref=ref,
        policy=doc.get("policy") or None,
        trusted_keys=tuple(_key_list(keys, "assets.trusted_keys")) if keys is not None else None,
        allow_unsigned=bool(doc.get("allow_unsigned", False)),
    )


@dataclass(frozen=True)
class ServingSettings:
    """What one vLLM start asked of modelpack; built by ``from_extra_config``."""

    source: str | None = None
    expected_digest: str | None = None
    trusted_keys: tuple[str, ...] = ()
    policy: str | None = None
    fingerprint: str | None = None
    events: str | None = None
    start_id: str | None = None
    shard_rules: dict[str, str] = field(default_factory=dict)
    plain_http: bool = False
    ca_file: str | None = None
    trust: str = "snapshot"
    assets: AssetSettings | None = None
    allow_extra_files: bool = False
    layout: str = "canonical"
    into_parameters: bool = True
    #: a node cache to stream ``source`` through (``loader.stream_through``), and what a rank
    #: reading only its share does about the rest
    cache: str | None = None
    cache_fill: str = "leave"
    #: the connection settings the environment gives (timeout, retry budget, mirrors, S3…), read
    #: by ``from_extra_config`` from the environ it was given; ``target_options`` adds this
    #: start's own ``plain_http`` and ``ca_file``
    environment_options: TargetOptions = field(
        default_factory=TargetOptions.from_environ, repr=False, compare=False
    )
    #: the environ ``from_extra_config`` read (the variant a start asks for comes from it too)
    environ: Mapping[str, str] = field(default_factory=lambda: os.environ, repr=False, compare=False)

    def variant_selector(self, tp_size: int | None = None) -> VariantSelector:
        """The index entry this start asks for (``MODELPACK_VARIANT``, ``_TP_SIZE``, ``_ACCELERATOR``
        of the environ it was read from), for the vLLM engine; ``tp_size`` is vLLM's own when known."""
        from modelpack.serving.variant_settings import selector_from_environ

        return selector_from_environ(self.environ, tp_size=tp_size, engine="vllm")

    def target_options(self) -> TargetOptions:
        """The options every registry read of this start uses: the environment's
        (``TargetOptions.from_environ``), with this start's ``plain_http`` and ``ca_file``."""
        return dataclasses.replace(self.environment_options, plain_http=self.plain_http, ca_file=self.ca_file)

    @property
    def pinned_digest(self) -> str | None:
        """The digest the weights must have: ``expected_digest``, else the source's ``@sha256:``."""
        if self.expected_digest:
            return self.expected_digest
        if self.source:
            ref = parse_reference(self.source)
            return str(ref.digest) if ref.digest else None
        return None

    @classmethod
    def from_extra_config(
        cls, extra: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None
    ) -> ServingSettings:
        env = os.environ if environ is None else environ
        doc = dict(extra or {})
        unknown = sorted(set(doc) - KNOWN_KEYS)
        if unknown:
            raise ServingConfigError(
                f"--model-loader-extra-config: unknown key(s) {unknown} for load format 'modelpack'; "
                f"known: {sorted(KNOWN_KEYS)}"
            )
        for key in _STR_KEYS:
            if key in doc and not isinstance(doc[key], str):
                raise ServingConfigError(f"--model-loader-extra-config: {key} must be a string")
        keys = _key_list(doc.get("trusted_keys", []), "trusted_keys")
        rules = doc.get("shard_rules", {})
        if not isinstance(rules, dict) or not all(
            isinstance(k, str) and v in ("replicate", "dim0", "dim1") for k, v in rules.items()
        ):
            raise ServingConfigError(
                "--model-loader-extra-config: shard_rules must map regexes to replicate, dim0 or dim1"
            )
        for flag, default in (("plain_http", False), ("allow_extra_files", False), ("into_parameters", True)):
            if not isinstance(doc.get(flag, default), bool):
                raise ServingConfigError(f"--model-loader-extra-config: {flag} must be true or false")
        trust = doc.get("trust", "snapshot")
        if trust not in TRUST_MODES:
            raise ServingConfigError(f"--model-loader-extra-config: trust must be one of {TRUST_MODES}")
        layout = doc.get("layout", "canonical")
        if layout not in LAYOUTS:
            raise ServingConfigError(f"--model-loader-extra-config: layout must be one of {LAYOUTS}")
        expected = doc.get("expected_digest")
        if expected:
            try:
                expected = str(Digest(expected))
            except ValueError as exc:
                raise ServingConfigError(f"--model-loader-extra-config: expected_digest: {exc}") from exc
        source = doc.get("source")
        if source:
            try:
                ref = parse_reference(source)
            except ValueError as exc:
                raise ServingConfigError(f"--model-loader-extra-config: source {source!r}: {exc}") from exc
            if not ref.digest and not expected:
                raise ServingConfigError(
                    f"--model-loader-extra-config: source {source!r} is not pinned; use {source}@sha256:… "
                    "or expected_digest (a tag can move between the ranks of one start)"
                )
            if trust != "snapshot":
                raise ServingConfigError(
                    "--model-loader-extra-config: trust applies to --model, not to source"
                )
        elif not expected:
            raise ServingConfigError(
                "--model-loader-extra-config: expected_digest is required when the weights come from --model "
                "(the manifest digest printed by 'modelpack pull --cache')"
            )
        cache_fill = doc.get("cache_fill", "leave")
        if cache_fill not in CACHE_FILL_MODES:
            raise ServingConfigError(
                f"--model-loader-extra-config: cache_fill must be one of {CACHE_FILL_MODES}"
            )
        if doc.get("cache") and not source:
            raise ServingConfigError(
                "--model-loader-extra-config: cache streams source through the node cache; without source "
                "--model is already read from one"
            )
        assets = _asset_settings(doc["assets"], source) if "assets" in doc else None
        return cls(
            source=source or None,
            expected_digest=expected or None,
            trusted_keys=tuple(keys),
            policy=doc.get("policy") or None,
            fingerprint=doc.get("fingerprint") or None,
            events=doc.get("events") or env_settings.EVENTS.get(env),
            start_id=env_settings.resolve_start_id(doc.get("start_id"), env),
            shard_rules=dict(rules),
            plain_http=bool(doc.get("plain_http", False)),
            ca_file=doc.get("ca_file") or None,
            trust=trust,
            assets=assets,
            allow_extra_files=bool(doc.get("allow_extra_files", False)),
            layout=layout,
            into_parameters=bool(doc.get("into_parameters", True)),
            cache=doc.get("cache") or None,
            cache_fill=cache_fill,
            environment_options=TargetOptions.from_environ(env),
            environ=env,
        )

    @property
    def assets_reference(self) -> str | None:
        """Where this start's assets are looked up, pinned to the weights' digest when it names none."""
        if self.assets is None:
            return None
        ref_text = self.assets.ref or self.source
        if ref_text is None:
            return None
        ref = parse_reference(ref_text)
        pinned = self.pinned_digest
        if ref.digest is None and pinned:
            return str(ref.with_digest(pinned))
        return str(ref)
