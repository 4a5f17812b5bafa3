"""Which read path each weight file takes, chosen by how far its bytes can be trusted and the device.

``weight_files.WeightFile.mode`` says what vouches for a file's bytes:

- ``trusted`` (node-cache snapshot, verified when it was filled): ``trusted.read_trusted_direct``
  on CPU, ``trusted.read_trusted_staged`` on CUDA or with ``direct_io``; with
  ``LoaderOptions.views`` on the CPU, a store blob trusted by inode is not read at all but
  mapped, and its tensors are views of it (``mapped.read_mapped``);
- ``chunks`` (a signed chunk table covers the layer): ``chunked.read_chunked``; with a process
  group (``LoaderOptions.group``) the ranks split the reads and broadcast what several need
  (``shared_read.read_chunked_shared``);
- ``whole`` (only the manifest's layer digest): ``whole_layer.read_whole_layer``;
- either of the last two, read from the node cache's ingest as it fills (``WeightFile.settled``,
  a stream-through load) into host tensors: ``settled.read_settled`` (unhashed here, held until
  the cache's own whole-blob check vouched for the blob).

Files are loaded in plan order; tensors are yielded as they complete, and the window is drained
at the end so the load finishes only when every read and copy has.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import cast

from modelpack.loader.chunked import read_chunked
from modelpack.loader.engine import LoadEngine
from modelpack.loader.mapped import read_mapped
from modelpack.loader.readers import FileReader
from modelpack.loader.settled import SettlingReader, read_settled, settles
from modelpack.loader.shared_read import read_chunked_shared
from modelpack.loader.trusted import read_trusted_direct, read_trusted_staged
from modelpack.loader.whole_layer import read_whole_layer


def run(load: LoadEngine) -> Iterator[int]:
    """Tensor ids, each once its tensor is complete and may be handed to the consumer."""
    for rel, fp in load.plan.files.items():
        f = load.files[rel]
        reader = load.readers[rel]
        if f.mappable and load.opts.views != "off" and not load.staged and not load.opts.direct_io:
            assert isinstance(reader, FileReader)
            yield from read_mapped(load, reader, fp)
        elif settles(load, f):
            yield from read_settled(load, cast(SettlingReader, reader), f, fp, load.alloc(fp, hold=True))
        elif f.mode == "trusted" and not load.staged and not load.opts.direct_io:
            yield from read_trusted_direct(load, reader, load.alloc(fp))
        elif f.mode == "trusted":
            yield from read_trusted_staged(load, reader, load.alloc(fp))
        elif f.mode == "chunks" and load.peers:
            peers = [p.files[rel] for p in load.peers]
            yield from read_chunked_shared(load, reader, f, fp, load.alloc(fp), peers)
        elif f.mode == "chunks":
            yield from read_chunked(load, reader, f, fp, load.alloc(fp))
        else:
            yield from read_whole_layer(load, reader, f, fp, load.alloc(fp))
        while load.ready:
            yield load.ready.popleft()
    yield from load.drain()
