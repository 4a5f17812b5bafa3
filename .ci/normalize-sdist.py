"""Rewrite an sdist (.tar.gz) so that the same files always give the same bytes.

setuptools stamps the gzip header and every member with the build's clock. This keeps the
members and their contents and sets: order by name, mtime = SOURCE_DATE_EPOCH, owner 0:0 with
no names, modes 0644 (0755 for directories and executables), gzip mtime = SOURCE_DATE_EPOCH and
no file name in the gzip header. Usage: normalize-sdist.py SDIST (rewritten in place).
"""

from __future__ import annotations

import gzip
import io
import os
import sys
import tarfile


def normalize(path: str, epoch: int) -> None:
    with tarfile.open(path, "r:gz") as src:
        members = sorted(src.getmembers(), key=lambda m: m.name)
        payload = {m.name: src.extractfile(m).read() for m in members if m.isfile()}  # type: ignore[union-attr]
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as dst:
        for m in members:
            if not (m.isfile() or m.isdir()):
                raise SystemExit(f"normalize-sdist: {m.name}: only files and directories belong in an sdist")
            m.mtime = epoch
            m.uid = m.gid = 0
            m.uname = m.gname = ""
            m.mode = 0o755 if m.isdir() or m.mode & 0o100 else 0o644
            m.pax_headers = {}
            dst.addfile(m, io.BytesIO(payload[m.name]) if m.isfile() else None)
    with open(path, "wb") as out, gzip.GzipFile(filename="", mode="wb", fileobj=out, mtime=epoch) as gz:
        gz.write(raw.getvalue())


if __name__ == "__main__":
    normalize(sys.argv[1], int(os.environ["SOURCE_DATE_EPOCH"]))
