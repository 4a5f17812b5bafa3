"""Streaming reads survive a dropped connection, and never splice two object versions.

A loopback TCP proxy between the client and moto_server cuts the first blob download partway
through its body (a real connection reset, not a mock); the stream resumes with a ranged GET.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from modelpack.errors import S3Error
from modelpack.oci.descriptor import Descriptor
from modelpack.oci.digest import Digest, VerifyingReader
from modelpack.targets.base import bytes_blob_source
from modelpack.targets.s3 import S3ReadStream, S3Settings, S3Target
from tests.fixtures.s3 import S3Server


class CuttingProxy:
    """Forwards 127.0.0.1:port → upstream; closes the first connection whose request contains
    ``trigger`` after ``cut_after`` response bytes, calling ``on_cut`` first."""

    def __init__(self, upstream: tuple[str, int], trigger: bytes, cut_after: int) -> None:
        self.upstream = upstream
        self.trigger = trigger
        self.cut_after = cut_after
        self.on_cut: Callable[[], None] | None = None
        self.cuts = 0
        #: until this monotonic time every new connection is closed at once (an endpoint restarting)
        self.down_until = 0.0
        self.refused = 0
        self._armed = False
        self._lock = threading.Lock()
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(32)
        self.port = self._listener.getsockname()[1]
        self._stop = False
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self._stop:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if time.monotonic() < self.down_until:
                self.refused += 1
                with contextlib.suppress(OSError):
                    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                client.close()  # a reset, as from a port nobody listens on
                continue
            server = socket.create_connection(self.upstream)
            self._conns += [client, server]
            state = {"armed": False, "sent": 0}
            threading.Thread(target=self._up, args=(client, server, state), daemon=True).start()
            threading.Thread(target=self._down, args=(server, client, state), daemon=True).start()

    def _up(self, client: socket.socket, server: socket.socket, state: dict[str, int]) -> None:
        try:
            while data := client.recv(65536):
                with self._lock:
                    # every matching request is armed until one cut has happened: a short
                    # ranged read (a header probe) that ends before ``cut_after`` is not the cut
                    if self.cuts == 0 and self.trigger in data:
                        self._armed = True
                        state["armed"] = 1
                        state["sent"] = 0
                server.sendall(data)
        except OSError:
            pass
        finally:
            with_suppress_shutdown(server)

    def _down(self, server: socket.socket, client: socket.socket, state: dict[str, int]) -> None:
        try:
            while data := server.recv(65536):
                if state["armed"]:
                    room = self.cut_after - state["sent"]
                    if len(data) >= room:
                        client.sendall(data[: max(room, 0)])
                        if self.on_cut:
                            self.on_cut()
                        self.cuts += 1
                        for sock in (client, server):  # shutdown wakes the peer pump's recv
                            with contextlib.suppress(OSError):
                                sock.shutdown(socket.SHUT_RDWR)
                            sock.close()
                        return
                    state["sent"] += len(data)
                client.sendall(data)
        except OSError:
            pass
        finally:
            with_suppress_shutdown(client)

    def close(self) -> None:
        self._stop = True
        self._listener.close()
        for c in self._conns:
            c.close()


def with_suppress_shutdown(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_WR)


@pytest.fixture
def blob(s3: S3Server) -> tuple[str, Descriptor, bytes]:
    bucket = s3.make_bucket()
    data = os.urandom(3 * 1024 * 1024 + 5)
    desc = Descriptor("application/octet-stream", Digest.from_bytes(data), len(data))
    S3Target(bucket, "m", endpoint=s3.endpoint, settings=S3Settings(part_size=1 << 20)).push_blob(
        bytes_blob_source(desc, data)
    )
    return bucket, desc, data


@pytest.fixture
def proxy(s3: S3Server, blob: tuple[str, Descriptor, bytes]) -> Iterator[CuttingProxy]:
    host, port = s3.endpoint.removeprefix("http://").split(":")
    p = CuttingProxy((host, int(port)), f"GET /{blob[0]}/m/blobs/sha256/".encode(), 700 * 1024)
    yield p
    p.close()


def _read_all(stream: object) -> bytes:
    out = bytearray()
    while chunk := stream.read(256 * 1024):  # type: ignore[attr-defined]
        out += chunk
    return bytes(out)


def test_dropped_download_resumes_with_the_same_bytes(
    blob: tuple[str, Descriptor, bytes], proxy: CuttingProxy, tmp_path: Path
) -> None:
    bucket, desc, data = blob
    target = S3Target(bucket, "m", endpoint=proxy.endpoint)
    with target.fetch_blob(desc) as stream:
        got = _read_all(VerifyingReader(stream, desc.digest, desc.size, source=target.name))
        assert isinstance(stream, S3ReadStream) and stream.resumes == 1
    assert proxy.cuts == 1
    assert got == data


def test_object_replaced_during_a_dropped_download_is_refused(
    s3: S3Server, blob: tuple[str, Descriptor, bytes], proxy: CuttingProxy
) -> None:
    bucket, desc, data = blob
    c = s3.client()
    other = bytes(reversed(data))
    proxy.on_cut = lambda: c.put_object(Bucket=bucket, Key=f"m/blobs/sha256/{desc.digest.hex}", Body=other)
    target = S3Target(bucket, "m", endpoint=proxy.endpoint)
    with pytest.raises(S3Error, match="changed while it was being read"), target.fetch_blob(desc) as stream:
        _read_all(stream)
    assert proxy.cuts == 1


def test_pack_from_s3_rides_out_an_endpoint_restart(s3: S3Server, checkpoint: Path, tmp_path: Path) -> None:
    """The S3 endpoint goes away mid-pack (its connection cut, every new one reset for 4 s, as a
    restarting moto or MinIO does) and comes back with the same objects: ``pack s3://…`` failed
    with ``S3 GetObject`` where ``pull`` from S3 rode it out. The read resumes from the byte it
    reached once the endpoint answers again, and the artifact is the local pack's."""
    from modelpack import api
    from modelpack.targets.opener import TargetOptions

    bucket = s3.make_bucket()
    s3.upload_dir(bucket, "ckpt", checkpoint)
    shard = max(checkpoint.glob("*.safetensors"), key=lambda p: p.stat().st_size)
    host, port = s3.endpoint.removeprefix("http://").split(":")
    proxy = CuttingProxy(
        (host, int(port)), f"GET /{bucket}/ckpt/{shard.name}".encode(), shard.stat().st_size // 3
    )

    def restart() -> None:
        proxy.down_until = time.monotonic() + 4.0

    proxy.on_cut = restart
    try:
        packed = api.pack(
            f"s3://{bucket}/ckpt/",
            f"oci:{tmp_path / 'layout'}:v1",
            target_options=TargetOptions(s3_endpoint=proxy.endpoint),
        )
    finally:
        proxy.close()
    assert proxy.cuts == 1 and proxy.refused >= 1
    assert packed.artifact.digest == api.pack(str(checkpoint), f"oci:{tmp_path / 'local'}:v1").artifact.digest
