"""Blob downloads from a registry repository: a stream from an offset, or an exact range.

Neither is verified here: the consumer (copy engine, pull, loader) does, because a registry
serves a corrupted stored blob without noticing. What is checked is that the bytes start where
asked (a 206's ``Content-Range``), and that a registry without range support has its prefix
skipped here, so a resumed read never splices in the wrong bytes.
"""

from __future__ import annotations

import re
from typing import Any, BinaryIO

import requests

from modelpack.errors import RegistryError, SizeMismatchError
from modelpack.oci.descriptor import Descriptor
from modelpack.targets.registry.repository import RepositoryAPI


class ResponseStream:
    """A blob download as a binary stream; closing it releases the connection."""

    def __init__(self, response: requests.Response) -> None:
        self._resp = response
        self._raw = response.raw

    def read(self, n: int = -1) -> bytes:
        data: bytes = self._raw.read(None if n is None or n < 0 else n, decode_content=False)
        return data

    def readinto(self, buf: Any) -> int:
        data = self.read(len(buf))
        buf[: len(data)] = data
        return len(data)

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        self._resp.close()

    def __enter__(self) -> ResponseStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_blob(repo: RepositoryAPI, descriptor: Descriptor, offset: int = 0) -> BinaryIO:
    """The blob from ``offset`` as a stream; closing it releases the connection."""
    headers = {"Range": f"bytes={offset}-"} if offset else {}
    resp = repo.client.request(
        "GET",
        repo.path("blobs", descriptor.digest),
        scopes=repo.scopes(),
        headers=headers,
        stream=True,
        ok=(200, 206),
        what=f"blob {descriptor.digest} from {repo.name}",
    )
    if resp.status_code == 206:
        _check_content_range(repo, resp, descriptor, offset)
    if offset and resp.status_code == 200:
        # no range support: skip the prefix ourselves (bounded reads)
        left = offset
        while left:
            data = resp.raw.read(min(left, 1 << 20), decode_content=False)
            if not data:
                resp.close()
                raise SizeMismatchError(descriptor.digest, descriptor.size, offset - left, source=repo.name)
            left -= len(data)
    return ResponseStream(resp)  # type: ignore[return-value]


def read_range(repo: RepositoryAPI, descriptor: Descriptor, offset: int, length: int) -> bytes:
    """Exactly ``length`` bytes at ``offset`` (a registry that ignores ``Range`` is skipped through)."""
    if length <= 0:
        return b""
    if offset < 0 or offset + length > descriptor.size:
        raise SizeMismatchError(descriptor.digest, descriptor.size, offset + length, source=repo.name)
    resp = repo.client.request(
        "GET",
        repo.path("blobs", descriptor.digest),
        scopes=repo.scopes(),
        headers={"Range": f"bytes={offset}-{offset + length - 1}"},
        stream=True,
        ok=(206,),
        allow=(200, 416),
        what=f"range of blob {descriptor.digest} from {repo.name}",
    )
    with resp:
        if resp.status_code == 416:
            # distribution 2.8's 416 carries a wrong Content-Length: never read its body
            raise RegistryError(
                f"range {offset}+{length} of blob {descriptor.digest} not satisfiable",
                status=416,
                target=repo.name,
            )
        if resp.status_code == 206:
            _check_content_range(repo, resp, descriptor, offset)
        if resp.status_code == 200:
            left = offset
            while left:
                chunk = resp.raw.read(min(left, 1 << 20), decode_content=False)
                if not chunk:
                    break
                left -= len(chunk)
        data = resp.raw.read(length + 1 if resp.status_code == 206 else length, decode_content=False)
    if len(data) != length:
        raise SizeMismatchError(descriptor.digest, length, len(data), source=f"{repo.name} range {offset}")
    return bytes(data)


def _check_content_range(
    repo: RepositoryAPI, resp: requests.Response, descriptor: Descriptor, offset: int
) -> None:
    """A 206 must start where we asked; anything else would splice the wrong bytes in."""
    m = re.match(r"^bytes (\d+)-(\d+)/(\d+|\*)$", resp.headers.get("Content-Range", "").strip())
    if not m or int(m.group(1)) != offset:
        resp.close()
        raise RegistryError(
            f"blob {descriptor.digest}: asked for bytes from {offset}, got Content-Range "
            f"{resp.headers.get('Content-Range')!r}",
            status=206,
            target=repo.name,
        )
