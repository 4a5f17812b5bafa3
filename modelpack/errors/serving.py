"""Errors of runtime assets (compile caches) and of serving engines."""

from __future__ import annotations

from collections.abc import Sequence

from modelpack.errors.base import ModelpackError
from modelpack.exit_codes import ExitCode


class AssetError(ModelpackError):
    """A runtime asset (compile cache) that cannot be packed, pushed, listed or materialised; the
    message names the model reference, the asset kind and, when known, the asset's digest."""


class AssetKindError(AssetError, ValueError):
    """An asset kind nobody registered (``inductor``, ``triton``, ``vllm`` are built in)."""

    exit_code = ExitCode.USAGE


class AssetFingerprintError(AssetError):
    """An environment fingerprint (a ``--fingerprint`` file or a stored asset's record) that is
    missing, oversized, malformed, or whose recorded digest does not match its fields."""


class AssetRefused(AssetError):
    """No stored asset may be used for this start: the nearest one differs in ``fields`` or failed
    verification (``reason``). Raised only on request (``require_hit``); a plain pull reports the
    refusal as its state, writes an ``assets.refused`` event, and the start proceeds cold."""

    def __init__(
        self, model: str, kind: str, reason: str, *, asset_digest: str = "", fields: Sequence[str] = ()
    ) -> None:
        at = f" (asset {asset_digest})" if asset_digest else ""
        super().__init__(f"{model}: {kind} asset refused{at}: {reason}")
        self.model = model
        self.kind = kind
        self.reason = reason
        self.asset_digest = asset_digest
        self.fields = list(fields)


class ServingError(ModelpackError):
    """A serving engine cannot take its weights through modelpack; the message names the model
    directory or reference and the setting a person has to change."""


class ServingConfigError(ServingError, ValueError):
    """``--model-loader-extra-config`` (or the model directory it points at) is unusable: an unknown
    key, a wrong type, an unpinned source, or config/tokenizer files that are not the pinned
    artifact's."""

    exit_code = ExitCode.USAGE


class ReadinessError(ServingError):
    """The served model did not become ready (health endpoint) or its deterministic check did not
    return the expected tokens; names the URL and what was seen."""
