"""Errors of LoRA adapters packed as artifacts whose ``subject`` is their base model."""

from __future__ import annotations

from modelpack.errors.base import ModelpackError


class AdapterError(ModelpackError):
    """An adapter directory, name or artifact that cannot be used (names the file, name or digest)."""


class AdapterSubjectError(AdapterError):
    """An adapter's base (its ``subject``, or ``--base``) does not resolve to a model manifest."""


class AdapterBaseMismatchError(AdapterError):
    """An adapter whose ``subject`` is another base than the one it is pulled or served with.

    Both digests are carried (and named in the message): the adapter's base, and the base at hand.
    """

    def __init__(self, adapter: str, adapter_digest: str, subject_digest: str, base_digest: str) -> None:
        super().__init__(
            f"adapter {adapter} ({adapter_digest}) was made for base {subject_digest}, not for "
            f"{base_digest}; refusing to use it with this base"
        )
        self.adapter = adapter
        self.adapter_digest = adapter_digest
        self.subject_digest = subject_digest
        self.base_digest = base_digest


class AdapterUntrustedError(AdapterError):
    """A cached adapter (or its base) with no record on this node of passing the trust its base
    passed: no policy verification the cache recorded for it, or one by keys the base's trust does
    not name. Carries the adapter's name (or the base's reference) and digest."""

    def __init__(self, what: str, digest: str, reason: str) -> None:
        super().__init__(f"{what} ({digest}): {reason}")
        self.what = what
        self.digest = digest
        self.reason = reason
