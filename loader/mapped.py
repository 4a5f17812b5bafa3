"""Read path for store blobs trusted by inode, on the CPU with views on: hand out the mapped file.

A node-cache snapshot file that ``snapshot_binding`` bound to the store's committed, read-only
blob (same inode, owned by root or the loading user, in directories nobody else can write) was
hashed when the cache committed it, and the trusted path already reads it without hashing. With
``LoaderOptions.views`` it is not even read: the file is mapped once (``MAP_PRIVATE``: writes to
a view are copy-on-write and never reach the blob) and each tensor is a view of that mapping, so
an engine that copies the weights into its own parameters — vLLM's ``weight_loader`` — reads
the page cache exactly once, as vLLM's default loader does with safetensors' mmap.

- ``views="shard"``: this rank's shard — the whole tensor, rows ``[b, e)`` (dim 0) or the
  columns ``[b, e)`` as a strided, non-contiguous view (dim 1). ``out=`` entries still win: those
  tensors are read into the caller's destinations.
- ``views="full"``: the whole tensor whatever the rule, for an engine that narrows each
  checkpoint tensor to its rank itself (``serving.full_shape``); ``out=`` does not apply to them
  (its entries are shard-shaped).

Not mapped (read as before): files that must be hashed (a view would expose unverified bytes),
plain directories (``--allow-unverified``: anybody who can write the file could truncate it under
the views), CUDA loads, ``direct_io``, and a tensor whose offset is not a multiple of its element
size. The mapping lives as long as the last view; the file's size is checked right before it is
mapped. What a view cannot protect against is the blob's owner (root, or the loading user)
making it writable and truncating it while an engine still copies from it: a fault in the
engine's copy is SIGBUS, as with any mmap-based loader. ``modelpack cache verify`` never
truncates a blob in place (it moves bad blobs out of the store).
"""

from __future__ import annotations

import mmap
from collections.abc import Iterator

import torch
from modelpack.loader.dtypes import torch_dtype
from modelpack.loader.engine import LoadEngine
from modelpack.loader.plan import FilePlan, ReadPlan, TensorRead
from modelpack.loader.readers import FileReader
from modelpack.loader.trusted import read_trusted_direct

from modelpack.errors import TruncatedSourceError


def map_file(reader: FileReader) -> torch.Tensor:
    """The whole file as one uint8 tensor over a private mapping (its size re-checked first)."""
    size = reader.fstat().st_size
    if size != reader.size:
        raise TruncatedSourceError(reader.path, 0, reader.size, size)
    if size == 0:
        return torch.empty(0, dtype=torch.uint8)
    m = mmap.mmap(reader.fileno(), size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return torch.frombuffer(m, dtype=torch.uint8)  # the tensor keeps the mapping alive


def tensor_view(
    base: torch.Tensor, begin: int, t: TensorRead, plan: ReadPlan, *, full: bool
) -> torch.Tensor | None:
    """``t`` (or, with ``full``, the whole tensor ``t`` is a shard of), which starts at file byte
    ``begin``, as a view of ``base``; None when that is not a multiple of its element size."""
    dt = torch_dtype(t.dtype, where=f"{t.file}: tensor {t.name!r}")
    es = torch.empty(0, dtype=dt).element_size()
    nbytes = es
    for d in t.full_shape:
        nbytes *= d
    if begin % es:
        return None
    whole = base[begin : begin + nbytes].view(dt).view(t.full_shape)
    if full or t.part is None or not t.sharded:
        return whole
    if t.part[3] != 1:
        return None  # every step-th expert of a stacked tensor: not one view, read it instead
    return t.select(whole)


def read_mapped(load: LoadEngine, reader: FileReader, fp: FilePlan) -> Iterator[int]:
    """Views for every tensor of the file that can be one; the rest through the direct read path."""
    full = load.opts.views == "full"
    base = map_file(reader)
    begins = {i.name: fp.header.data_start + i.begin for i in fp.header.tensors}
    rest: list[TensorRead] = []
    for t in fp.tensors:
        claimed = not full and load.out is not None and t.name in load.out
        view = None if claimed else tensor_view(base, begins[t.name], t, load.plan, full=full)
        if view is None:
            rest.append(t)
            continue
        load.adopt(t, view)
        reader.count(t.nbytes, t.span.offset, t.span.end)
        load.stats.mapped_bytes += view.numel() * view.element_size()
    del base
    if rest:
        ids = load.alloc(FilePlan(fp.file, fp.header, rest))
        yield from read_trusted_direct(load, reader, ids)


__all__ = ["map_file", "read_mapped", "tensor_view"]
