"""The one blob writer, driven directly through its faults, once per partial strategy.

Both strategies (a directory pull's partial beside the final path, the node cache's
``ingest/<hex>.partial`` under the digest lock) go through the same cases: a cut is resumed with
a Range request, a corrupt resumed prefix is thrown away and fetched again from zero, a source
that sends too many or too few bytes or the wrong ones leaves nothing, a cancel leaves nothing,
a full disk keeps a partial the next writer resumes, and a second writer of the same blob never
writes into the partial a live writer holds. The source is a real OCI layout whose blob file is
damaged where a case needs a lying source.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import pytest
from modelpack.mount.ingest import BlobIngest, IngestSlot
from modelpack.mount.locks import HeldLock, acquire
from modelpack.mount.modes import READ_ONLY_FILE_MODE
from modelpack.mount.store import Store

from modelpack.errors import (
    DigestMismatchError,
    DiskFullError,
    PullError,
    SizeMismatchError,
    TransferCancelled,
)
from modelpack.files import TEMP_PREFIX
from modelpack.oci.descriptor import Descriptor
from modelpack.oci.digest import Digest
from modelpack.targets.base import file_blob_source
from modelpack.targets.layout import OCILayoutTarget
from modelpack.transfer.blob_writer import (
    Downloaded,
    Landing,
    PartialSlot,
    WriteHooks,
    fetch_verified,
    open_writer,
)
from modelpack.transfer.cancel import Cancel
from modelpack.transfer.staging import BesideFinal, partial_path
from tests.mount.test_cache_support import FaultySource, Interrupted
from tests.pull_dir_helpers import small_tmpfs

pytestmark = pytest.mark.timeout(120)

MiB = 1024 * 1024
SIZE = 3 * MiB


@dataclass
class Source:
    """A real OCI layout holding one blob; ``blob_file`` is what it serves (damaged on purpose)."""

    target: OCILayoutTarget
    desc: Descriptor
    data: bytes

    @property
    def blob_file(self) -> Path:
        return Path(self.target.blob_path(self.desc.digest))

    def serve(self, data: bytes) -> None:
        """From now on the source sends ``data`` for the blob (a lying or broken registry)."""
        self.blob_file.chmod(0o644)
        self.blob_file.write_bytes(data)


@pytest.fixture
def source(tmp_path: Path) -> Source:
    data = os.urandom(SIZE)
    target = OCILayoutTarget(str(tmp_path / "layout"), create=True)
    blob = tmp_path / "blob"
    blob.write_bytes(data)
    desc = Descriptor("application/octet-stream", Digest.from_bytes(data), len(data))
    target.push_blob(file_blob_source(desc, str(blob)))
    return Source(target, desc, data)


class Strategy:
    """Where one strategy keeps the partial and commits the blob, under ``root``."""

    def __init__(self, kind: str, root: Path, digest: Digest) -> None:
        self.kind = kind
        self.digest = digest
        if kind == "directory":
            self.final = root / "model" / "w.bin"
            self.final.parent.mkdir(parents=True)
            self.partial = Path(partial_path(str(self.final), digest))
            self.landing = Landing(str(self.final), what=f"blob for {self.final}")
        else:
            self.store = Store(str(root / "cache"))
            self.final = Path(self.store.blob_path(digest))
            self.partial = Path(self.store.partial_path(digest))
            self.landing = Landing(str(self.final), mode=READ_ONLY_FILE_MODE, name_partial=True)

    @contextlib.contextmanager
    def slot(self) -> Iterator[PartialSlot]:
        """The slot a writer opens; for the node cache, under the digest lock held meanwhile."""
        if self.kind == "directory":
            yield BesideFinal(str(self.partial))
            return
        held: HeldLock = acquire(self.store.lock_path(self.digest))
        try:
            yield IngestSlot(self.store, self.digest, held)
        finally:
            held.release()

    def fetch(self, target: Any, desc: Descriptor, hooks: WriteHooks | None = None) -> Downloaded:
        with self.slot() as slot:
            return fetch_verified(target, desc, slot, self.landing, hooks)

    def leftovers(self) -> list[str]:
        """Partials and temp files in this strategy's directory (none after a commit or a failure
        that keeps nothing)."""
        names = (p.name for p in self.partial.parent.iterdir())
        return sorted(n for n in names if n.startswith(TEMP_PREFIX) or n.endswith(".partial"))


STRATEGIES = ["directory", "node-cache"]


@pytest.fixture(params=STRATEGIES)
def strategy(request: pytest.FixtureRequest, tmp_path: Path, source: Source) -> Strategy:
    return Strategy(request.param, tmp_path / "out", source.desc.digest)


def _cut(strategy: Strategy, source: Source, at: int) -> None:
    """A first download that loses its connection after ``at`` bytes: the partial is kept."""
    with pytest.raises(Interrupted):
        strategy.fetch(FaultySource(source.target, str(source.desc.digest), at), source.desc)
    assert strategy.partial.stat().st_size == at
    assert not strategy.final.exists()


def test_a_cut_download_is_resumed_with_a_range_request(strategy: Strategy, source: Source) -> None:
    """After a dropped connection the next writer re-hashes the kept bytes and asks only for the rest."""
    cut = SIZE // 3
    _cut(strategy, source, cut)
    resumed: list[int] = []
    src = FaultySource(source.target)
    got = strategy.fetch(src, source.desc, WriteHooks(on_resume=resumed.append))
    assert src.offsets == [(source.desc.digest, cut)]
    assert src.served[source.desc.digest] == SIZE - cut
    assert (got.resumed, got.fetched, resumed) == (cut, SIZE - cut, [cut])
    assert strategy.final.read_bytes() == source.data
    assert strategy.leftovers() == []


def test_a_committed_blob_is_read_only_where_the_caller_asks(strategy: Strategy, source: Source) -> None:
    """The mode comes from the landing: the node cache's blobs are read-only, a pulled file is not."""
    strategy.fetch(source.target, source.desc)
    mode = strategy.final.stat().st_mode & 0o777
    assert mode == (0o644 if strategy.kind == "directory" else READ_ONLY_FILE_MODE)


def test_a_corrupt_resumed_prefix_is_thrown_away_and_refetched(strategy: Strategy, source: Source) -> None:
    """A torn write in the kept prefix fails the final check; the writer fetches once more from zero."""
    cut = SIZE // 2
    _cut(strategy, source, cut)
    with open(strategy.partial, "r+b") as f:
        f.seek(10)
        f.write(b"garbage!")
    discarded: list[int] = []
    src = FaultySource(source.target)
    got = strategy.fetch(src, source.desc, WriteHooks(on_discard=discarded.append))
    assert discarded == [cut]
    assert src.offsets == [(source.desc.digest, cut), (source.desc.digest, 0)]
    assert src.served[source.desc.digest] == SIZE - cut + SIZE
    assert (got.resumed, got.fetched) == (0, SIZE - cut + SIZE)
    assert strategy.final.read_bytes() == source.data
    assert strategy.leftovers() == []


def test_bytes_written_to_a_partial_never_change_a_discarding_writer_starts_a_new_file(
    strategy: Strategy, source: Source
) -> None:
    """A stream-through load reads a partial while it grows and trusts those bytes once the cache
    verified the blob, telling the verified file apart by inode. So a writer that throws bytes away
    (a resumed prefix that fails the check) must not rewrite them in place: it starts a new file,
    and a reader holding the old one still sees exactly what it read, while the committed blob and
    the ``on_verified`` stat name the new inode."""
    cut = SIZE // 2
    _cut(strategy, source, cut)
    with open(strategy.partial, "r+b") as f:
        f.seek(10)
        f.write(b"garbage!")
    follower = os.open(strategy.partial, os.O_RDONLY)  # a stream-through reader of the partial
    try:
        before = os.fstat(follower)
        seen = os.pread(follower, cut, 0)
        verified: list[os.stat_result] = []
        strategy.fetch(FaultySource(source.target), source.desc, WriteHooks(on_verified=verified.append))
        # the old file: what was read is still there, the first try appended, nothing truncated
        assert os.pread(follower, cut, 0) == seen and os.fstat(follower).st_size == SIZE
        committed = strategy.final.stat()
        assert (committed.st_dev, committed.st_ino) != (before.st_dev, before.st_ino)
        assert len(verified) == 1
        assert (verified[0].st_dev, verified[0].st_ino) == (committed.st_dev, committed.st_ino)
        assert strategy.final.read_bytes() == source.data
        assert strategy.leftovers() == []
    finally:
        os.close(follower)


def test_on_verified_names_the_file_holding_the_checked_bytes_and_is_not_called_for_wrong_ones(
    strategy: Strategy, source: Source
) -> None:
    verified: list[os.stat_result] = []
    strategy.fetch(source.target, source.desc, WriteHooks(on_verified=verified.append))
    st = strategy.final.stat()
    assert [(v.st_dev, v.st_ino, v.st_size) for v in verified] == [(st.st_dev, st.st_ino, SIZE)]
    wrong = bytearray(source.data)
    wrong[SIZE // 2] ^= 1
    source.serve(bytes(wrong))
    strategy.final.chmod(0o600)
    strategy.final.unlink()
    verified.clear()
    with pytest.raises(DigestMismatchError):
        strategy.fetch(source.target, source.desc, WriteHooks(on_verified=verified.append))
    assert verified == []


@pytest.mark.parametrize("sent", ["longer", "shorter"])
def test_a_source_that_lies_about_the_size_leaves_nothing(
    strategy: Strategy, source: Source, sent: str
) -> None:
    """More bytes than declared, or fewer: refused, nothing at the final path, no partial."""
    source.serve(source.data + b"x" if sent == "longer" else source.data[:-1])
    with pytest.raises(SizeMismatchError) as err:
        strategy.fetch(source.target, source.desc)
    assert err.value.actual == (SIZE + 1 if sent == "longer" else SIZE - 1)
    assert not strategy.final.exists()
    assert strategy.leftovers() == []


def test_a_digest_mismatch_leaves_nothing(strategy: Strategy, source: Source) -> None:
    """Right size, wrong bytes: refused, nothing at the final path, no partial to resume from."""
    source.serve(bytes(SIZE))
    with pytest.raises(DigestMismatchError):
        strategy.fetch(source.target, source.desc)
    assert not strategy.final.exists()
    assert strategy.leftovers() == []


def test_a_cancel_mid_download_keeps_a_partial_the_next_fetch_resumes(
    strategy: Strategy, source: Source
) -> None:
    """A sibling failed (or a signal came): the writer stops within a read and keeps its verified
    bytes; the next fetch re-hashes them and appends only the rest."""
    cancel = Cancel()

    def on_bytes(_n: int) -> None:
        cancel.set()

    with pytest.raises(TransferCancelled):
        strategy.fetch(source.target, source.desc, WriteHooks(cancel=cancel, on_bytes=on_bytes))
    assert not strategy.final.exists()
    kept = strategy.partial.stat().st_size
    assert 0 < kept < SIZE
    got = strategy.fetch(source.target, source.desc)
    assert (got.resumed, got.fetched) == (kept, SIZE - kept)
    assert strategy.final.read_bytes() == source.data
    assert strategy.leftovers() == []


def test_a_symlink_planted_at_the_partials_name_is_never_written_through(
    strategy: Strategy, source: Source, tmp_path: Path
) -> None:
    """A link at the partial's name (to a file the writer must never append to) is replaced:
    the link's target keeps its bytes, and the blob is written and committed whole."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    strategy.partial.parent.mkdir(parents=True, exist_ok=True)
    strategy.partial.symlink_to(victim)
    got = strategy.fetch(source.target, source.desc)
    assert (got.resumed, got.fetched) == (0, SIZE)
    assert victim.read_bytes() == b"precious"
    assert strategy.final.read_bytes() == source.data
    assert strategy.leftovers() == []


class SignalledSource:
    """A real layout whose blob stream is interrupted by a signal (``KeyboardInterrupt``) after
    its first read."""

    def __init__(self, layout: OCILayoutTarget) -> None:
        self.layout = layout
        self.name = layout.name

    def fetch_blob(self, descriptor: Descriptor, offset: int = 0) -> BinaryIO:
        f = self.layout.fetch_blob(descriptor, offset)
        reads = 0

        class Stream:
            def read(self, n: int = -1) -> bytes:
                nonlocal reads
                reads += 1
                if reads > 1:
                    raise KeyboardInterrupt
                return f.read(n)

            def __enter__(self) -> Stream:
                return self

            def __exit__(self, *exc: object) -> None:
                f.close()

        return Stream()  # type: ignore[return-value]


def test_a_signal_mid_download_keeps_a_partial_the_next_fetch_resumes(
    strategy: Strategy, source: Source
) -> None:
    """Ctrl-C (or SIGTERM turned into an exception) while bytes arrive: nothing final, the bytes
    written so far kept, and the rerun fetches only the rest."""
    with pytest.raises(KeyboardInterrupt):
        strategy.fetch(SignalledSource(source.target), source.desc)
    assert not strategy.final.exists()
    kept = strategy.partial.stat().st_size
    assert 0 < kept < SIZE
    got = strategy.fetch(source.target, source.desc)
    assert (got.resumed, got.fetched) == (kept, SIZE - kept)
    assert strategy.final.read_bytes() == source.data


def test_a_takeover_writers_private_file_is_removed_when_its_download_fails(
    tmp_path: Path, source: Source
) -> None:
    """The node cache's writer that took a stale lock over writes a private temp file (the holder
    may still write the partial); when its source drops the connection that file goes, since no
    later writer would ever find it to resume."""
    strategy = Strategy("node-cache", tmp_path / "out", source.desc.digest)
    cut = FaultySource(source.target, str(source.desc.digest), SIZE // 2)
    # the first slot is the hung holder's
    with strategy.slot(), strategy_slot_stale(strategy) as second, pytest.raises(Interrupted):
        fetch_verified(cut, source.desc, second, strategy.landing)
    assert os.listdir(strategy.store.ingest_dir) == []
    assert not strategy.final.exists()


@pytest.mark.parametrize("kind", STRATEGIES)
def test_a_full_disk_keeps_a_partial_the_next_writer_resumes(
    tmp_path: Path, source: Source, kind: str
) -> None:
    """The disk fills up mid-download: a typed error naming the path and the kept bytes; once
    there is room, the next writer resumes them instead of starting over."""
    with small_tmpfs(tmp_path / "disk", "2m") as disk:
        assert disk is not None, "tests run as root and may mount a tmpfs"
        strategy = Strategy(kind, disk, source.desc.digest)
        with pytest.raises(DiskFullError) as err:
            strategy.fetch(source.target, source.desc)
        kept = strategy.partial.stat().st_size
        assert kept > 0 and not strategy.final.exists()
        named = strategy.partial if kind == "node-cache" else strategy.final
        assert str(err.value).startswith(str(named)) and "resume" in str(err.value), err.value
        subprocess.run(["mount", "-o", "remount,size=8m", str(disk)], check=True, capture_output=True)
        src = FaultySource(source.target)
        got = strategy.fetch(src, source.desc)
        assert (got.resumed, src.offsets) == (kept, [(source.desc.digest, kept)])
        assert strategy.final.read_bytes() == source.data
        assert strategy.leftovers() == []


@pytest.mark.parametrize("kind", STRATEGIES)
def test_a_disk_full_before_the_first_byte_says_nothing_was_kept(
    tmp_path: Path, source: Source, kind: str
) -> None:
    """The disk is already full when the first bytes arrive: the empty partial is removed (it
    resumes nothing), so the error must not claim it was kept (CI saw "kept in …" name a file
    that was gone)."""
    with small_tmpfs(tmp_path / "disk", "1m") as disk:
        assert disk is not None, "tests run as root and may mount a tmpfs"
        strategy = Strategy(kind, disk, source.desc.digest)
        filler = disk / "filler"
        with contextlib.suppress(OSError), filler.open("wb") as f:
            while True:
                f.write(b"\0" * 65536)
        with pytest.raises(DiskFullError) as err:
            strategy.fetch(source.target, source.desc)
        assert "nothing was kept" in str(err.value) and "kept in" not in str(err.value), err.value
        assert strategy.leftovers() == [] and not strategy.final.exists()


def test_a_second_writer_never_writes_into_a_live_writers_partial(strategy: Strategy, source: Source) -> None:
    """While one writer holds the partial, a second writer of the same blob is refused (directory)
    or writes a private temp file of its own (node cache, lock judged stale): the first writer's
    bytes stay as it wrote them and its commit is whole."""
    half = SIZE // 2
    with strategy.slot() as slot, open_writer(slot, source.desc) as first:
        first.resume()
        first.write(source.data[:half], strategy.landing)
        if strategy.kind == "directory":
            with pytest.raises(PullError, match="another pull is writing"):
                strategy.fetch(source.target, source.desc)
        else:
            with strategy_slot_stale(strategy) as second:
                got = fetch_verified(source.target, source.desc, second, strategy.landing)
            assert got.resumed == 0 and got.fetched == SIZE
        assert strategy.partial.read_bytes() == source.data[:half]
        first.write(source.data[half:], strategy.landing)
        first.commit(SIZE, source.desc.digest, strategy.landing)
    assert strategy.final.read_bytes() == source.data
    assert strategy.leftovers() == []


@contextlib.contextmanager
def strategy_slot_stale(strategy: Strategy) -> Iterator[PartialSlot]:
    """The node cache's second writer: the digest lock is held, its heartbeat judged stale at once."""
    held = acquire(strategy.store.lock_path(strategy.digest), stale_after=0.0)
    assert not held.exclusive and held.stale
    yield IngestSlot(strategy.store, strategy.digest, held)


class GatedSource:
    """A real layout whose blob stream opens only once ``gate`` is set; counts what it is asked for."""

    def __init__(self, layout: OCILayoutTarget) -> None:
        self.layout = layout
        self.name = layout.name
        self.fetching = threading.Event()
        self.gate = threading.Event()
        self.asked = 0  # bytes the source was asked for

    def fetch_blob(self, descriptor: Descriptor, offset: int = 0) -> BinaryIO:
        self.fetching.set()
        assert self.gate.wait(30), "the second ingest never waited on the digest lock"
        self.asked += descriptor.size - offset
        return self.layout.fetch_blob(descriptor, offset)


def test_two_ingests_of_one_digest_download_it_once(tmp_path: Path, source: Source) -> None:
    """Two caches on one root (no shared in-process state) ingest the same blob at once: the
    second waits on the digest lock, then finds the blob the first committed and fetches nothing."""
    root = str(tmp_path / "cache")
    first, second = BlobIngest(Store(root)), BlobIngest(Store(root))
    src = GatedSource(source.target)
    results: dict[str, Any] = {}

    def run(name: str, ingest: BlobIngest, **kw: Any) -> None:
        try:
            results[name] = ingest.ingest(source.desc, src, **kw)  # type: ignore[arg-type]
        except BaseException as exc:  # surfaced below
            results[name] = exc

    def on_event(name: str, **_fields: Any) -> None:
        if name == "cache.lock_wait":
            src.gate.set()  # the first may go on only once the second waits for its lock

    a = threading.Thread(target=run, args=("first", first))
    a.start()
    assert src.fetching.wait(30)
    b = threading.Thread(target=run, args=("second", second), kwargs={"on_event": on_event})
    b.start()
    a.join(60)
    b.join(60)
    assert results["first"].downloaded == SIZE, results
    assert results["second"].existed and results["second"].downloaded == 0, results
    assert src.asked == SIZE
    assert Path(first.store.blob_path(source.desc.digest)).read_bytes() == source.data
