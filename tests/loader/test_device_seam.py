"""The device seam (``loader/device_copier.py``) and the stand-in device the tests run it over.

The stand-in must behave as CUDA does where a loader can go wrong: a copy completes later than it
is issued, in order within a stream; an event or a stream synchronize waits for exactly the work
before it; a pinned source overwritten while its copy is pending, or a tensor handed out while a
copy into it is pending, is caught. Then the loader, run through it, must leave nothing behind when
a load fails half-way (a device out of memory, a corrupt chunk): every pinned slot freed, no copy
pending, no tensor of the failed part handed out.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from modelpack.loader import LoaderOptions, LoadStats, iter_tensors, load_state_dict
from modelpack.loader.device_copier import StreamCopier
from modelpack.loader.device_standin import POISON, StandinDevice, StandinViolation
from modelpack.signing.chunks import compute_chunk_table

from modelpack.errors import ChunkDigestMismatch
from tests.loader_helpers import corrupt, pack_layout, reference_tensors

pytestmark = pytest.mark.host_copier  # these tests pick their device themselves


def _slow_device() -> StandinDevice:
    return StandinDevice(seed=1, max_delay_s=0.05)


def test_a_copy_completes_after_it_is_issued_and_its_event_waits_for_it() -> None:
    dev = _slow_device()
    try:
        src = dev.pinned(4096)
        src.fill_(7)
        dst = dev.empty((4096,), torch.uint8)
        side = dev.stream()
        for _ in range(20):  # a delay of 0 may be drawn once; twenty in a row may not
            dev.copy(dst, src, side)
        ev = dev.record(side)
        assert bool((dst == POISON).all()) and not ev.query(), "the copy ran as it was issued"
        ev.synchronize()
        assert ev.query() and bool((dst == 7).all())
        dev.free_pinned(src)
    finally:
        dev.close()


def test_copies_on_one_stream_run_in_order_and_wait_stream_orders_two_streams() -> None:
    dev = _slow_device()
    try:
        a, b = dev.pinned(4096), dev.pinned(4096)
        a.fill_(1)
        b.fill_(2)
        dst = dev.empty((4096,), torch.uint8)
        s1, s2 = dev.stream(), dev.stream()
        dev.copy(dst, a, s1)
        dev.copy(dst, b, s1)  # later on the same stream: its bytes are what stays
        s1.synchronize()
        assert bool((dst == 2).all())
        out = dev.empty((4096,), torch.uint8)
        dev.copy(dst, a, s1)
        s2.wait_stream(s1)
        dev.copy(out, dst, s2)  # reads dst only after s1's copy into it ran
        s2.synchronize()
        assert bool((out == 1).all())
        dev.free_pinned(a)
        dev.free_pinned(b)
    finally:
        dev.close()


def test_a_pinned_source_overwritten_before_its_copy_ran_is_caught() -> None:
    """What a staging slot reused before its copy completed looks like: the source changed while
    the copy was pending. The next synchronize raises; the destination is poisoned."""
    dev = _slow_device()
    src = dev.pinned(4096)
    src.fill_(3)
    dst = dev.empty((4096,), torch.uint8)
    side = dev.stream()
    for _ in range(20):
        dev.copy(dst, src, side)
    src.fill_(4)  # a reader refilling the slot
    with pytest.raises(StandinViolation, match="reused before its copy completed"):
        side.synchronize()
    assert bool((dst == POISON).all())
    dev.free_pinned(src)
    dev.close()


def test_a_tensor_handed_out_while_a_copy_into_it_is_pending_is_caught() -> None:
    dev = _slow_device()
    copier = StreamCopier(torch.device("cpu"), dev)
    copier.open_slots(1, 4096)
    slot = copier.acquire()
    slot.host.fill_(5)
    dst = copier.empty((4096,), torch.uint8)
    for _ in range(20):
        copier.copy(dst, copier.to_device(slot, 0, 4096))
    done = copier.record()
    with pytest.raises(StandinViolation, match="handed out"):
        copier.hand_out(dst, None)  # without waiting for ``done``
    assert copier.hand_out(dst, done) is dst  # after it: complete
    assert bool((dst == 5).all())
    copier.release(slot)
    copier.close()
    dev.close()
    assert dev.pinned_live == 0 and dev.pending == 0


def test_the_device_seam_waits_for_a_slot_before_reusing_it() -> None:
    """``acquire`` returns a slot only after the copies queued out of it completed, so filling it
    again can never change a pending copy's source."""
    dev = _slow_device()
    copier = StreamCopier(torch.device("cpu"), dev)
    copier.open_slots(1, 4096)
    dst = copier.empty((2, 4096), torch.uint8)
    for i in range(2):
        slot = copier.acquire()
        slot.host.fill_(10 + i)
        copier.copy(dst[i], copier.to_device(slot, 0, 4096))
        copier.release(slot)
    t = copier.hand_out(dst, copier.record())
    assert bool((t[0] == 10).all()) and bool((t[1] == 11).all())
    copier.close()
    dev.close()
    assert dev.violations == [] and dev.pinned_live == 0


def test_a_device_out_of_memory_mid_load_frees_every_slot_and_hands_out_only_whole_tensors(
    checkpoint: Path, standin: StandinDevice
) -> None:
    """The second file's destinations do not fit: the load raises the device's OOM; the tensors
    handed out before it are complete, and every pinned slot is freed, no copy left pending."""
    ref = reference_tensors(checkpoint)
    load_state_dict(str(checkpoint), allow_unverified=True)
    need = standin.allocated
    standin.allocated = 0
    model_bytes = sum(t.nbytes for t in ref.values())
    standin.fail_after_bytes = need - model_bytes // 3
    got: dict[str, torch.Tensor] = {}
    with pytest.raises(torch.OutOfMemoryError, match="stand-in device"):
        for name, t in iter_tensors(str(checkpoint), allow_unverified=True):
            got[name] = t
    assert 0 < len(got) < len(ref)
    for name, t in got.items():
        assert torch.equal(t, ref[name]), name
    assert standin.pinned_live == 0 and standin.pending == 0


@pytest.mark.parametrize("tp", [1, 2])
def test_a_corrupt_chunk_on_the_device_path_fails_the_load_and_leaks_nothing(
    checkpoint: Path, tmp_path: Path, standin: StandinDevice, tp: int
) -> None:
    """Staged through pinned slots (the device path), a flipped byte in the second file fails the
    load with ``ChunkDigestMismatch``; no tensor of the bad chunk was handed out, every tensor
    handed out equals the checkpoint, and the slots are all freed."""
    layout = pack_layout(checkpoint, tmp_path / "layout")
    table = compute_chunk_table(layout.target, layout.manifest, 64 * 1024)
    ref = reference_tensors(checkpoint)
    _, blob = layout.weight_blob("00002")
    size = blob.stat().st_size
    corrupt(blob, size - 100)  # inside the last tensor of the second file
    got: dict[str, torch.Tensor] = {}
    stats = LoadStats()
    with pytest.raises(ChunkDigestMismatch):
        for name, t in iter_tensors(
            layout.ref,
            chunk_table=table,
            tp_size=tp,
            tp_rank=0,
            stats=stats,
            options=LoaderOptions(slot_bytes=64 * 1024, slots=3),
        ):
            got[name] = t
    assert stats.plan is not None
    bad = {t.name for t in stats.plan.tensors if t.file.endswith("00002-of-00002.safetensors")}
    last = max((t for t in stats.plan.tensors if t.name in bad), key=lambda t: t.span.offset + t.span.nbytes)
    assert last.name not in got
    whole = {t.name for t in stats.plan.tensors if not t.sharded}
    for name, t in got.items():
        if name in whole:
            assert torch.equal(t, ref[name]), name
    assert standin.pinned_live == 0 and standin.pending == 0
