"""Rollback protection for tags: the newest signed version this node cache accepted, per tag.

A signature binds a digest, not a tag, so a registry (or anyone who can move tags) could point
``:v1`` back at an older version the same key once signed. As TUF-style clients do with
versions, the node cache remembers per tag (canonical ``registry/repository`` + tag) the newest
signing time it has accepted (``signing.signing_time``: inside the signed statement), and a
tag pull under a policy refuses a version signed earlier (``RollbackRefused``) unless the
caller allows it (``pull --allow-rollback``; the accepted version then becomes the bar).
Untimed signatures count as time 0. Equal times are accepted.

::

    tag-history/                 0755, the cache owner's; never repaired silently
    tag-history/<key>.json       0644, one per tag; key = sha256("name:tag")[:40]
        {version: 1, repository, tag,
         newest: {digest, signedAt, acceptedAt},      the bar
         history: [{digest, signedAt, acceptedAt, rollback?}, …]}   at most MAX_HISTORY, oldest first

Records are written atomically by the cache owner, read with a size and depth bound. Unlike
other records, a record that cannot be trusted does not read as absent — absent would lower the
bar to nothing: a file of another uid, a symlink, one writable by others, a malformed or
oversized one, or a directory another uid could write into, refuses the tag pull
(``TagHistoryError``), naming the file and the fix. ``--allow-rollback`` replaces it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from modelpack.mount.modes import DIR_MODE, FILE_MODE, untrusted_reason

from modelpack.boundedjson import loads_object
from modelpack.errors import DocumentError, RollbackRefused, TagHistoryError
from modelpack.files import atomic_write_bytes
from modelpack.oci.digest import Digest
from modelpack.oci.reference import Reference

HISTORY_DIR = "tag-history"
MAX_RECORD_BYTES = 64 * 1024
MAX_HISTORY = 32
RECORD_VERSION = 1


def _time_text(seconds: float) -> str:
    from modelpack.signing.signing_time import format_signing_time

    return format_signing_time(seconds) if seconds else ""


def _describe(seconds: float) -> str:
    from modelpack.signing.signing_time import describe_signing_time

    return describe_signing_time(seconds)


def _parse_time(text: Any, where: str) -> float:
    """'' is an untimed version (0); anything else must be RFC 3339 UTC."""
    if text == "":
        return 0.0
    from modelpack.signing.signing_time import parse_signing_time

    return parse_signing_time(text, where=where)


@dataclass(frozen=True)
class TagVersion:
    """One version accepted for a tag: its digest, signing time (0: untimed), when accepted."""

    digest: str
    signed_at: float
    accepted_at: float
    rollback: bool = False

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "digest": self.digest,
            "signedAt": _time_text(self.signed_at),
            "acceptedAt": _time_text(self.accepted_at),
        }
        if self.rollback:
            doc["rollback"] = True
        return doc

    @classmethod
    def from_json(cls, doc: Any, where: str) -> TagVersion:
        if not isinstance(doc, dict):
            raise ValueError(f"{where}: a version must be an object")
        return cls(
            str(Digest(doc["digest"])),
            _parse_time(doc["signedAt"], f"{where} signedAt"),
            _parse_time(doc["acceptedAt"], f"{where} acceptedAt"),
            doc.get("rollback") is True,
        )


@dataclass(frozen=True)
class TagRecord:
    """What the cache knows of one tag."""

    repository: str
    tag: str
    newest: TagVersion
    history: tuple[TagVersion, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "version": RECORD_VERSION,
            "repository": self.repository,
            "tag": self.tag,
            "newest": self.newest.to_json(),
            "history": [v.to_json() for v in self.history],
        }


@dataclass(frozen=True)
class RollbackDecision:
    """Whether a version may be accepted for a tag, and why (sigstore-python style)."""

    allowed: bool
    reason: str
    newest: TagVersion | None = None


def tag_key(ref: Reference) -> tuple[str, str] | None:
    """(canonical ``registry/repository``, tag) for a reference resolved through a tag; None for
    a digest-pinned one (the caller chose the digest: no tag is involved)."""
    if ref.digest or not ref.tag:
        return None
    return ref.canonical_name, ref.tag


class TagHistory:
    """``tag-history/``: per tag, the newest signed version accepted and the ones before it."""

    def __init__(self, cache_root: str, owner: int, *, locks_dir: str | None = None) -> None:
        self.owner = owner
        self.dir = os.path.join(cache_root, HISTORY_DIR)
        self.locks_dir = locks_dir or os.path.join(cache_root, "locks")

    def path(self, repository: str, tag: str) -> str:
        name = hashlib.sha256(f"{repository}:{tag}".encode()).hexdigest()[:40]
        return os.path.join(self.dir, name + ".json")

    # ------------------------------------------------------------------ reading
    def _check_dir(self) -> bool:
        """True when the directory exists and only the cache owner (or root) can write it."""
        try:
            st = os.lstat(self.dir)
        except FileNotFoundError:
            return False
        if not stat.S_ISDIR(st.st_mode):
            raise self._untrusted(self.dir, "not a directory (a symlink or file)")
        reason = untrusted_reason(st, self.owner)
        if reason is not None:
            raise self._untrusted(self.dir, reason)
        return True

    def _untrusted(self, path: str, reason: str, ref: str = "") -> TagHistoryError:
        return TagHistoryError(
            ref or self.dir,
            "",
            f"the tag history {path} cannot be trusted: {reason}; another user may have replaced or "
            "removed the record of the newest version accepted. Check it, remove it (as the cache "
            "owner), or pull with --allow-rollback to accept this version and start the history again",
        )

    def _read(self, path: str, where: str) -> TagRecord | None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise self._untrusted(path, "a symlink", where) from None
            raise
        try:
            st = os.fstat(fd)
            reason = untrusted_reason(st, self.owner)
            if reason is None and not stat.S_ISREG(st.st_mode):
                reason = "not a regular file"
            if reason is not None:
                raise self._untrusted(path, reason, where)
            raw = os.read(fd, MAX_RECORD_BYTES + 1)
        finally:
            os.close(fd)
        if len(raw) > MAX_RECORD_BYTES:
            raise self._untrusted(path, f"larger than {MAX_RECORD_BYTES} bytes", where)
        try:
            doc = loads_object(raw, what=path, max_bytes=MAX_RECORD_BYTES, max_depth=4)
            if doc.get("version") != RECORD_VERSION:
                raise ValueError(f"record version {doc.get('version')!r}")
            history = doc["history"]
            if not isinstance(history, list) or len(history) > MAX_HISTORY:
                raise ValueError(f"history must be a list of at most {MAX_HISTORY}")
            return TagRecord(
                str(doc["repository"]),
                str(doc["tag"]),
                TagVersion.from_json(doc["newest"], "newest"),
                tuple(TagVersion.from_json(v, "history") for v in history),
            )
        except (DocumentError, ValueError, KeyError, TypeError) as exc:
            raise self._untrusted(path, f"malformed ({exc})", where) from exc

    def read(self, ref: Reference) -> TagRecord | None:
        """The record of ``ref``'s tag; None when the tag was never accepted here (or ``ref`` is
        pinned by digest). ``TagHistoryError`` when a record exists that cannot be trusted."""
        key = tag_key(ref)
        if key is None or not self._check_dir():
            return None
        record = self._read(self.path(*key), str(ref))
        if record is not None and (record.repository, record.tag) != key:
            raise self._untrusted(self.path(*key), f"it names {record.repository}:{record.tag}", str(ref))
        return record

    def for_repository(self, repository: str) -> Iterator[TagRecord]:
        """Every readable record of a canonical repository name (``audit --cache``); records that
        cannot be trusted are left out here (audit reports, it decides nothing)."""
        if not os.path.isdir(self.dir):
            return
        with os.scandir(self.dir) as entries:
            for entry in entries:
                if not entry.name.endswith(".json"):
                    continue
                try:
                    record = self._read(entry.path, entry.path)
                except TagHistoryError:
                    continue
                if record is not None and record.repository == repository:
                    yield record

    # ------------------------------------------------------------------ deciding
    def decide(self, ref: Reference, digest: str, signed_at: float) -> RollbackDecision:
        """May ``digest`` (signed at ``signed_at``; 0: untimed) be accepted for ``ref``'s tag?"""
        record = self.read(ref)
        if record is None:
            return RollbackDecision(True, "first version accepted for this tag on this node")
        newest = record.newest
        if signed_at >= newest.signed_at:
            return RollbackDecision(True, "not older than the newest accepted", newest)
        return RollbackDecision(
            False,
            f"{digest} signed {_describe(signed_at)} is older than {newest.digest} "
            f"signed {_describe(newest.signed_at)}",
            newest,
        )

    def check(self, ref: Reference, digest: str, signed_at: float, *, allow_rollback: bool) -> bool:
        """Raise ``RollbackRefused`` for an older version (unless ``allow_rollback``); returns
        whether the version is a rollback that was allowed."""
        try:
            decision = self.decide(ref, digest, signed_at)
        except TagHistoryError:
            if allow_rollback:
                return True
            raise
        if decision.allowed:
            return False
        if allow_rollback:
            return True
        assert decision.newest is not None
        raise RollbackRefused(
            str(ref),
            digest,
            _describe(signed_at),
            decision.newest.digest,
            _describe(decision.newest.signed_at),
        )

    # ------------------------------------------------------------------ recording
    def accept(self, ref: Reference, digest: str, signed_at: float, *, rollback: bool = False) -> None:
        """Record ``digest`` as accepted for the tag (after ``check``), under the tag's lock. The
        bar only moves forward, unless ``rollback`` (``--allow-rollback``) says otherwise: a
        concurrent pull that accepted a newer version meanwhile keeps its bar, and this version
        joins the history. Nothing is written when it already is the bar (a hit costs a read)."""
        key = tag_key(ref)
        if key is None:
            return
        if self._is_bar(ref, digest, signed_at):
            return
        self._ensure_dir(rollback)
        from modelpack.mount.locks import acquire, default_lock_timeout

        path = self.path(*key)
        lock = acquire(
            os.path.join(self.locks_dir, "tag-" + os.path.basename(path)[:-5] + ".lock"),
            timeout=default_lock_timeout(),
        )
        try:
            try:
                record = self.read(ref)
            except TagHistoryError:
                if not rollback:
                    raise
                record = None  # --allow-rollback: the untrusted record is replaced
            version = TagVersion(digest, signed_at, time.time(), rollback)
            newest = version
            if record is not None and not rollback and record.newest.signed_at > signed_at:
                newest = record.newest  # a newer version was accepted while this one was pulled
            history = [*(record.history if record else ()), version][-MAX_HISTORY:]
            new = TagRecord(key[0], key[1], newest, tuple(history))
            self._replace_foreign(path)
            atomic_write_bytes(path, json.dumps(new.to_json(), sort_keys=True).encode(), mode=FILE_MODE)
        finally:
            lock.release()

    def _is_bar(self, ref: Reference, digest: str, signed_at: float) -> bool:
        try:
            record = self.read(ref)
        except TagHistoryError:
            return False
        return record is not None and record.newest.digest == digest and record.newest.signed_at == signed_at

    def _ensure_dir(self, repair: bool) -> None:
        try:
            os.mkdir(self.dir, DIR_MODE)
        except FileExistsError:
            pass
        else:
            os.chmod(self.dir, DIR_MODE)
            return
        if repair:  # --allow-rollback: the operator re-establishes the history
            st = os.lstat(self.dir)
            if stat.S_ISDIR(st.st_mode) and st.st_uid in (self.owner, 0):
                os.chmod(self.dir, DIR_MODE)
        self._check_dir()

    def _replace_foreign(self, path: str) -> None:
        """An untrusted file at ``path`` (only reached with --allow-rollback) is removed first,
        so the atomic rename does not inherit anything of it."""
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        if not stat.S_ISREG(st.st_mode) or untrusted_reason(st, self.owner) is not None:
            os.unlink(path)


@dataclass(frozen=True)
class PendingAcceptance:
    """A version that passed the rollback check; ``accept`` records it once it is published."""

    history: TagHistory | None
    ref: Reference
    digest: str
    signed_at: float
    rollback: bool = False

    def accept(self) -> None:
        if self.history is not None:
            self.history.accept(self.ref, self.digest, self.signed_at, rollback=self.rollback)


@dataclass(frozen=True)
class RollbackGuard:
    """The pull path's rollback check: refuse (event, then ``RollbackRefused``) or let through."""

    history: TagHistory
    allow_rollback: bool = False

    def check(
        self, ref: Reference, digest: str, signed_at: float | None, ev: Callable[..., None]
    ) -> PendingAcceptance:
        """``signed_at`` None (no signature verified: the policy allowed unsigned) counts as 0."""
        seconds = signed_at or 0.0
        if tag_key(ref) is None:
            return PendingAcceptance(None, ref, digest, seconds)
        try:
            rolled_back = self.history.check(ref, digest, seconds, allow_rollback=self.allow_rollback)
        except RollbackRefused as exc:
            ev(
                "cache.rollback_refused",
                digest=digest,
                signed_at=exc.signed_at,
                newest_digest=exc.newest_digest,
                newest_signed_at=exc.newest_signed_at,
                reason=exc.reason,
            )
            raise
        except TagHistoryError as exc:
            ev("cache.rollback_refused", digest=digest, reason=exc.reason)
            raise
        if rolled_back:
            ev("cache.rollback_allowed", digest=digest, signed_at=_describe(seconds))
        return PendingAcceptance(self.history, ref, digest, seconds, rolled_back)
