"""A range of a blob read through the mirrors, then the origin (``read_range_through``; the
loader's streaming calls it through ``MirroredBlobs.read_range``).

A range cannot be verified alone, so the caller may pass ``check`` (the loader's signed chunk
table): the chunks of a mirror's bytes that fail it are fetched again from the next source and
finally the origin, chunk by chunk; a mirror that errors is left for the next one. Each read
emits one ``registry.range_sources`` event (bytes per source).
"""

from __future__ import annotations

from collections.abc import Callable

from modelpack.errors import ModelpackError, RegistryError, TransferInterrupted
from modelpack.oci.descriptor import Descriptor
from modelpack.targets.base import RangeCheck
from modelpack.targets.registry.blob_reads import Floor, read_range
from modelpack.targets.registry.mirror_ledger import Mirror, SourceLedger


def read_range_through(
    ledger: SourceLedger,
    mirrors: list[Mirror],
    desc: Descriptor,
    offset: int,
    length: int,
    check: RangeCheck | None,
    *,
    floor: Floor | None = None,
) -> bytes:
    """Exactly ``length`` bytes at ``offset`` from the first source that serves them. With
    ``check``, the chunks a mirror got wrong are fetched again from the next source and the
    origin (the loader verifies every chunk against the signed chunk table either way)."""
    split: dict[str, int] = {}
    urls: dict[str, str] = {}

    def got(name: str, url: str, n: int) -> None:
        ledger.count(name, n)
        if n:
            split[name] = split.get(name, 0) + n
            urls[name] = url

    try:
        return _read_range(ledger, mirrors, desc, offset, length, check, got, floor)
    finally:
        if ledger.events is not None and split:
            ledger.events.emit(
                "registry.range_sources",
                blob=str(desc.digest),
                offset=offset,
                bytes=sum(split.values()),
                sources=split,
                source_urls=urls,
            )


def _read_range(
    ledger: SourceLedger,
    mirrors: list[Mirror],
    desc: Descriptor,
    offset: int,
    length: int,
    check: RangeCheck | None,
    got: Callable[[str, str, int], None],
    floor: Floor | None,
) -> bytes:
    out: bytearray | None = None
    missing = [(offset, length)]
    for mirror in mirrors:
        left: list[tuple[int, int]] = []
        for o, n in missing:
            try:
                data = read_range(mirror.repo, desc, o, n, floor=floor)
            except TransferInterrupted:
                raise
            except (RegistryError, ModelpackError) as exc:
                ledger.mirror_failed(mirror, desc, exc, o)
                left.append((o, n))
                continue
            bad = check(o, data) if check is not None else []
            if bad:
                first = bad[0][0]
                ledger.abandon(
                    mirror,
                    desc,
                    f"digest mismatch: {len(bad)} chunk(s) of range {o}+{n} are wrong",
                    first,
                    failure="digest_mismatch",
                )
            if not bad and o == offset and n == length:
                got(mirror.name, mirror.endpoint.url, len(data))
                return data
            if out is None:
                out = bytearray(length)
            out[o - offset : o - offset + n] = data
            got(mirror.name, mirror.endpoint.url, n - sum(b for _, b in bad))
            left.extend(bad)
        missing = left
        if not missing:
            break
    for o, n in missing:
        data = read_range(ledger.origin, desc, o, n)
        got(ledger.origin_name, ledger.origin_url, len(data))
        if o == offset and n == length and out is None:
            return data
        if out is None:
            out = bytearray(length)
        out[o - offset : o - offset + n] = data
    assert out is not None
    return bytes(out)
