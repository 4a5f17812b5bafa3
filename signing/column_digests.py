"""The digests of a 2-D tensor's column blocks, from its bytes in file order.

Block ``j`` of a tensor of ``rows`` rows of ``row_bytes`` bytes cut into ``blocks`` equal blocks is
every row's ``j``-th slice of ``row_bytes / blocks`` bytes, rows in order; its digest is the
sha256 of that concatenation (docs/signing.md, ``columns``). The signer feeds a tensor's bytes as
they stream past; the loader feeds a column-split share it received (a share of whole blocks is
itself such a tensor: its rows are the share's slices, cut into the share's blocks), so both
hash the same bytes the same way.

numpy, where installed (it comes with torch, which the loader needs), gathers each block of a
run of whole rows in one copy; without it every row slice is hashed on its own (same digests,
slower: a signer without the ``torch`` extra).
"""

from __future__ import annotations

import hashlib
from typing import Any

_np: Any
try:  # pragma: no branch - one of the two, per environment
    import numpy as _np
except ImportError:  # pragma: no cover - numpy comes with torch; the test set-up has it
    _np = None

__all__ = ["ColumnDigester"]


class ColumnDigester:
    """sha256 of each column block, fed the tensor's bytes in order in pieces of any length."""

    def __init__(self, rows: int, row_bytes: int, blocks: int, *, use_numpy: bool = True) -> None:
        if blocks < 1 or row_bytes % blocks:
            raise ValueError(f"{blocks} column blocks do not divide rows of {row_bytes} bytes")
        self.rows = rows
        self.row_bytes = row_bytes
        self.blocks = blocks
        self.width = row_bytes // blocks
        self._hashers = [hashlib.sha256() for _ in range(blocks)]
        self._carry = bytearray()  # the start of a row that the last piece cut
        self._fed = 0
        self._np: Any = _np if use_numpy else None

    @property
    def complete(self) -> bool:
        return self._fed == self.rows * self.row_bytes

    def update(self, piece: bytes | bytearray | memoryview) -> None:
        """Feed the next bytes of the tensor (never past its end)."""
        data = memoryview(piece).cast("B")
        if self._fed + len(data) > self.rows * self.row_bytes:
            raise ValueError("more bytes than the tensor holds")
        self._fed += len(data)
        if self._carry:
            take = min(len(data), self.row_bytes - len(self._carry))
            self._carry += data[:take]
            data = data[take:]
            if len(self._carry) < self.row_bytes:
                return
            self._rows(memoryview(self._carry))
            self._carry = bytearray()
        whole = len(data) - len(data) % self.row_bytes
        if whole:
            self._rows(data[:whole])
        if whole < len(data):
            self._carry += data[whole:]

    def _rows(self, data: memoryview) -> None:
        """Hash whole rows into their blocks."""
        if self.blocks == 1:
            self._hashers[0].update(data)
            return
        n = len(data) // self.row_bytes
        if self._np is not None:
            grid = self._np.frombuffer(data, dtype=self._np.uint8).reshape(n, self.blocks, self.width)
            for j, h in enumerate(self._hashers):
                h.update(self._np.ascontiguousarray(grid[:, j, :]).data)
            return
        w = self.width
        for r in range(n):
            base = r * self.row_bytes
            for j, h in enumerate(self._hashers):
                h.update(data[base + j * w : base + (j + 1) * w])

    def digests(self) -> list[bytes]:
        """The blocks' digests, once every byte of the tensor was fed."""
        if not self.complete:
            raise ValueError(f"fed {self._fed} of {self.rows * self.row_bytes} bytes")
        return [h.digest() for h in self._hashers]
