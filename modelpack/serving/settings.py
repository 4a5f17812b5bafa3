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
``events``            JSON-lines event log (default: ``$MODELPACK_EVENTS``); t2–t5 and refusals
``start_id``          groups this start's events (default: ``$MODELPACK_START_ID``)
``shard_rules``       ``{regex: replicate|dim0|dim1}`` tried before the vLLM-derived rules
``plain_http``, ``ca_file``   registry connection settings (loopback registries need neither)
``trust``             ``snapshot`` (default) or ``runtime``: ``--model`` is an image volume whose
                      digest the container runtime verified (pinned in the pod spec); the loader
                      then reads it as a plain directory and records the pin only in its events
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from modelpack.errors import ServingConfigError
from modelpack.oci.digest import Digest
from modelpack.oci.reference import parse_reference

_STR_KEYS = ("source", "expected_digest", "policy", "fingerprint", "events", "start_id", "ca_file", "trust")
KNOWN_KEYS = frozenset({*_STR_KEYS, "trusted_keys", "shard_rules", "plain_http"})
TRUST_MODES = ("snapshot", "runtime")


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
        keys = doc.get("trusted_keys", [])
        if isinstance(keys, str):
            keys = [keys]
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise ServingConfigError("--model-loader-extra-config: trusted_keys must be a list of paths")
        rules = doc.get("shard_rules", {})
        if not isinstance(rules, dict) or not all(
            isinstance(k, str) and v in ("replicate", "dim0", "dim1") for k, v in rules.items()
        ):
            raise ServingConfigError(
                "--model-loader-extra-config: shard_rules must map regexes to replicate, dim0 or dim1"
            )
        if not isinstance(doc.get("plain_http", False), bool):
            raise ServingConfigError("--model-loader-extra-config: plain_http must be true or false")
        trust = doc.get("trust", "snapshot")
        if trust not in TRUST_MODES:
            raise ServingConfigError(f"--model-loader-extra-config: trust must be one of {TRUST_MODES}")
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
        return cls(
            source=source or None,
            expected_digest=expected or None,
            trusted_keys=tuple(keys),
            policy=doc.get("policy") or None,
            fingerprint=doc.get("fingerprint") or None,
            events=doc.get("events") or env.get("MODELPACK_EVENTS") or None,
            start_id=doc.get("start_id") or env.get("MODELPACK_START_ID") or None,
            shard_rules=dict(rules),
            plain_http=bool(doc.get("plain_http", False)),
            ca_file=doc.get("ca_file") or None,
            trust=trust,
        )
