"""KServe's storage initializer: ``SRC_URI DEST [SRC_URI DEST …]`` → verified files at each DEST.

The contract (kserve ``pkg/webhook/admission/pod/storage_initializer_injector.go`` and
``pkg/controller/v1alpha1/localmodelnode/controller.go``): the container gets argv pairs
``SRC_URI DEST_PATH`` (one pair, ``/mnt/models``, for an InferenceService's ``storageUri`` and
for a LocalModelNode download Job; several for ``storageUris`` when the ClusterStorageContainer
says ``supportsMultiModelDownload``), runs as uid 1000 and must exit non-zero on any error.

Per pair, after the trust policy (``MODELPACK_POLICY``) accepted the manifest digest:

- with a node cache (``MODELPACK_CACHE``, a hostPath shared by the node's pods): the cache's
  pull (one download per node, resumable, verified before publication, a hit without network
  when pinned) and then ``placement`` links or copies the snapshot's files into DEST;
- without one, or for a URI that selects files (``?include=``/``?exclude=``: the cache publishes
  whole models; with a node cache the selected blobs are still committed to its store on their
  way to DEST, ``mount.store_first``, and the snapshot is left to a full pull): the trusted-resolve step (``mount.resolve``: policy, variant, and with a node
  cache its tag history, so a filter never skips the rollback check) pins the digest, then
  ``transfer.materialize`` downloads each file into DEST through a resumable partial and
  renames it only once its digest matched.

Either way a rerun over a complete DEST fetches no blob, a partial one fetches what is missing,
and nothing unverified is ever at a path in DEST.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from modelpack.errors import ModelpackError, StorageInitializerError
from modelpack.events import EventLog, NullEventLog
from modelpack.mount.cache import NodeCache
from modelpack.mount.resolve import resolve_trusted
from modelpack.mount.store_first import StoreFirstTarget
from modelpack.oci.descriptor import Manifest
from modelpack.oci.digest import verify_bytes
from modelpack.serving.kserve.placement import DIR_MODE, place_snapshot
from modelpack.serving.kserve.progress_lines import CountingTarget, ProgressLines, human_size
from modelpack.serving.kserve.settings import InitializerSettings
from modelpack.serving.kserve.uri import StorageUri, parse_storage_uri
from modelpack.targets.opener import TargetOptions, open_readable
from modelpack.transfer.materialize import PullOptions, pull_to_directory

if TYPE_CHECKING:
    from modelpack.signing.policy import TrustPolicy

USAGE = "expected SRC_URI DEST pairs: SRC_URI DEST [SRC_URI DEST …]"


@dataclass
class PairResult:
    uri: str
    dest: str
    digest: str
    state: str  # hit | cold (node cache) | direct (no cache)
    files: int
    bytes_downloaded: int
    placed: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "uri": self.uri,
            "dest": self.dest,
            "digest": self.digest,
            "state": self.state,
            "files": self.files,
            "bytesDownloaded": self.bytes_downloaded,
            "placed": self.placed,
            "seconds": round(self.seconds, 3),
        }


def parse_pairs(args: Sequence[str]) -> list[tuple[StorageUri, str]]:
    """The argv pairs, each URI parsed; an odd count or an empty DEST is a ``StorageInitializerError``."""
    if len(args) < 2 or len(args) % 2:
        raise StorageInitializerError(f"{USAGE} (got {len(args)} argument(s))")
    pairs = []
    for uri, dest in zip(args[0::2], args[1::2], strict=True):
        if not dest:
            raise StorageInitializerError(f"{uri}: empty DEST")
        pairs.append((parse_storage_uri(uri), os.path.abspath(dest)))
    dests = [d for _, d in pairs]
    if len(set(dests)) != len(dests):
        raise StorageInitializerError(f"two URIs name the same DEST: {', '.join(sorted(dests))}")
    return pairs


class StorageInitializer:
    """Runs the pairs in order; ``say`` gets the progress and summary lines (stdout in the CLI)."""

    def __init__(
        self,
        settings: InitializerSettings,
        *,
        say: Callable[[str], None],
        timeout: float | None = None,
        retry_for: float | None = None,
    ) -> None:
        self.settings = settings
        self.say = say
        self.target_options = settings.target_options(timeout=timeout, retry_for=retry_for)
        self.policy: TrustPolicy | None = _load_policy(settings)
        self.variant = settings.variant  # an index of variants: the entry for this node
        self.cache = (
            NodeCache(settings.cache_dir, events=settings.events_path) if settings.cache_dir else None
        )
        self.events: EventLog = (
            self.cache.events
            if self.cache is not None
            else (EventLog(settings.events_path) if settings.events_path else NullEventLog())
        )

    def run(self, pairs: Sequence[tuple[StorageUri, str]]) -> list[PairResult]:
        results = []
        for i, (uri, dest) in enumerate(pairs, 1):
            label = f"[{i}/{len(pairs)}] {uri.text} → {dest}"
            try:
                result = self._one(uri, dest, label)
            except ModelpackError as exc:
                self.events.emit(
                    "kserve.refused", reference=uri.text, dest=dest, error=type(exc).__name__, reason=str(exc)
                )
                raise
            self.events.emit("kserve.ready", reference=uri.text, **result.to_json())
            what = "ready" if result.digest in uri.text else f"{result.digest} ready"
            self.say(
                f"{label}: {what}, {result.files} files ({result.state}; downloaded "
                f"{human_size(result.bytes_downloaded)}{_placed(result.placed)}) in {result.seconds:.1f} s"
            )
            results.append(result)
        return results

    def _one(self, uri: StorageUri, dest: str, label: str) -> PairResult:
        t0 = time.monotonic()
        _make_dest(dest)
        options = self.target_options.bound_to(uri.reference)
        target = CountingTarget(open_readable(uri.reference, options))
        via = f"through the node cache {self.cache.root}" if self.cache is not None else "into DEST"
        self.say(f"{label}: starting, {via}")
        with ProgressLines(label, target, self.say, self.settings.progress_interval):
            if self.cache is not None and not uri.selects_files:  # the cache holds whole models
                return self._through_cache(uri, dest, target, options, t0)
            return self._direct(uri, dest, target, t0)

    def _through_cache(
        self, uri: StorageUri, dest: str, target: CountingTarget, options: TargetOptions, t0: float
    ) -> PairResult:
        assert self.cache is not None
        pulled = self.cache.pull(
            uri.reference,
            options,
            policy=self.policy,
            jobs=self.settings.jobs,
            source=target,
            variant=self.variant,
        )
        with self.cache.open_snapshot(str(pulled.digest)) as snapshot:
            placement = place_snapshot(snapshot, dest, link=self.settings.link)
        return PairResult(
            uri.text,
            dest,
            str(pulled.digest),
            pulled.state,
            placement.files,
            pulled.bytes_downloaded,
            placement.to_json(),
            time.monotonic() - t0,
        )

    def _direct(self, uri: StorageUri, dest: str, target: CountingTarget, t0: float) -> PairResult:
        # the trust step first, filter or not: with a node cache its tag history is consulted
        # (a tag moved back to an older signed version is refused here as in the cache's pull)
        pinned = resolve_trusted(
            uri.reference,
            policy=self.policy,
            selector=self.variant,
            target=target,
            events=self.events,
            cache=self.cache,
        )
        if pinned.variant is not None:
            self.say(
                f"{uri.text}: variant {_fields(pinned.variant.selection.chosen.fields)} ({pinned.digest})"
            )
        options = PullOptions(
            include=uri.include,
            exclude=uri.exclude,
            jobs=self.settings.jobs,
            progress="off",
            force=True,  # DEST is the initializer's: a stale file is replaced by a verified one
        )
        if self.cache is None:
            pulled = pull_to_directory(target, pinned.digest, dest, options)
        else:
            pulled = self._direct_through_store(target, pinned.digest, dest, options, uri)
        pinned.accept()
        return PairResult(
            uri.text,
            dest,
            pulled.digest,
            "direct",
            len(pulled.files),
            pulled.bytes_downloaded,
            {"files": len(pulled.files), "present": pulled.present},
            time.monotonic() - t0,
        )

    def _direct_through_store(
        self, target: CountingTarget, digest: str, dest: str, options: PullOptions, uri: StorageUri
    ) -> Any:
        """A file-filtered URI with a node cache: each selected blob is committed to the cache's
        store on its way to DEST (``mount.store_first``), from the same registry read; the snapshot
        of the whole model is left to a full pull, which finds them committed."""
        assert self.cache is not None
        raw, _ = target.fetch_manifest(digest)
        verify_bytes(raw, digest, None, what="manifest", source=target.name)
        manifest = Manifest.parse(raw)
        needed = [digest, *{str(d.digest) for d in [manifest.config, *manifest.layers]}]
        source = StoreFirstTarget(target, self.cache.store, self.cache.blobs)
        with self.cache.leases.hold(needed):  # GC leaves the fresh blobs alone meanwhile
            pulled = pull_to_directory(source, digest, dest, options)
        self.events.emit(
            "kserve.cache_left",
            reference=uri.text,
            digest=digest,
            left_to="fill",
            blobs=sorted(source.ingested),
            bytes=sum(source.ingested.values()),
            reason="a file-filtered URI: its blobs are in the node cache, the snapshot is left to a full pull",
        )
        return pulled


def _fields(fields: Any) -> str:
    return " ".join(f"{k}={v}" for k, v in fields.items()) or "(no variant fields)"


def _load_policy(settings: InitializerSettings) -> TrustPolicy | None:
    if settings.policy_path:
        from modelpack.signing.policy import TrustPolicy

        return TrustPolicy.load(settings.policy_path)
    if settings.policy_yaml:
        from modelpack.signing.policy import TrustPolicy

        return TrustPolicy.from_text(settings.policy_yaml, "$MODELPACK_POLICY_YAML")
    return None


def _placed(placed: dict[str, Any]) -> str:
    how = placed.get("placed") or {}
    parts = [f"{n} {kind}" for kind, n in sorted(how.items())]
    if placed.get("present"):
        parts.append(f"{placed['present']} already present")
    return "; " + ", ".join(parts) if parts else ""


def _make_dest(dest: str) -> None:
    if os.path.isdir(dest):
        return
    os.makedirs(dest, DIR_MODE, exist_ok=True)
    os.chmod(dest, DIR_MODE)
