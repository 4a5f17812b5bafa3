"""The framing of a ``206 multipart/byteranges`` answer (RFC 9110 §14.6, RFC 2046 §5.1), read
from a registry that may be hostile.

Only the framing is read here, each piece bounded: the boundary (1 to 70 characters of RFC 2046's
set, from the ``Content-Type``), blank lines before the first delimiter and each part's headers
(together at most ``MAX_PART_HEADER_BYTES`` per part), each delimiter line (its own length plus
``MAX_PADDING`` bytes of transport padding). A part's data is not read here: the caller receives
exactly the bytes its ``Content-Range`` names (which must be the range asked for) into its own
memory, then asks for the next delimiter, which must follow at once. So an answer costs the asked
bytes plus bounded framing, whatever the registry sends; anything that is not the framing asked
for is a ``FramingError`` (its reason, for the caller's error naming the blob and the range), and
a body that ends where more was due is ``BodyEnded`` (a cut, or the registry's whole answer:
the caller knows which from how the body was delimited).
"""

from __future__ import annotations

import re
from typing import Protocol

#: RFC 2046: a boundary is 1 to 70 characters
MAX_BOUNDARY = 70
#: blank lines before a part's delimiter plus its header lines, at most (Go sends about 100 bytes)
MAX_PART_HEADER_BYTES = 8 * 1024
#: spaces and tabs allowed after a delimiter (RFC 2046's transport padding)
MAX_PADDING = 64
_BOUNDARY = re.compile(r"[0-9A-Za-z'()+_,\-./:=? ]{0,69}[0-9A-Za-z'()+_,\-./:=?]")
_CONTENT_RANGE = re.compile(r"bytes (\d{1,19})-(\d{1,19})/(\d{1,19})")
_PADDING = re.compile(rb"[ \t]*(\r?\n)?")
_MEDIA_TYPE = "multipart/byteranges"


class FramingError(Exception):
    """The answer is not the multipart/byteranges framing asked for; ``str()`` says why."""


class BodyEnded(Exception):
    """The body ended, without a transport error, where more of the framing was due."""


class Body(Protocol):
    """A response body: lines (at most ``limit`` bytes, the line end included) and raw bytes."""

    def readline(self, limit: int) -> bytes: ...


def content_range(value: str) -> tuple[int, int, int] | None:
    """``bytes FIRST-LAST/SIZE`` as ``(first, last, size)``; None for anything else (``*`` sizes,
    unsatisfied ranges, ``last < first``)."""
    m = _CONTENT_RANGE.fullmatch(value.strip())
    if m is None:
        return None
    first, last, size = (int(g) for g in m.groups())
    return (first, last, size) if first <= last else None


def multipart_boundary(content_type: str) -> bytes | None:
    """The boundary of a ``multipart/byteranges`` ``Content-Type``; None for another type.
    ``FramingError`` for a multipart type without a usable boundary."""
    media, _, params = content_type.partition(";")
    if media.strip().lower() != _MEDIA_TYPE:
        return None
    boundary: str | None = None
    for param in params.split(";"):
        name, eq, value = param.partition("=")
        if not eq or name.strip().lower() != "boundary":
            continue
        if boundary is not None:
            raise FramingError("two boundary parameters in the Content-Type")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] == '"':
            value = value[1:-1]
        boundary = value
    if boundary is None:
        raise FramingError("a multipart/byteranges Content-Type without a boundary")
    if len(boundary) > MAX_BOUNDARY:
        raise FramingError(f"a multipart boundary of {len(boundary)} characters (at most {MAX_BOUNDARY})")
    if not _BOUNDARY.fullmatch(boundary):
        raise FramingError(f"an invalid multipart boundary {boundary[:MAX_BOUNDARY]!r}")
    return boundary.encode("ascii")


class PartReader:
    """Reads the framing around the parts of one multipart answer, in order: ``next_part`` before
    each part's data, ``end`` after the last one's."""

    def __init__(self, body: Body, boundary: bytes) -> None:
        self._body = body
        self._delimiter = b"--" + boundary
        self._line_limit = len(self._delimiter) + 2 + MAX_PADDING + 2
        self._first = True
        #: framing bytes read so far (delimiters, headers)
        self.framing = 0
        #: parts begun
        self.parts = 0

    def _readline(self, limit: int) -> bytes:
        line = self._body.readline(limit)
        self.framing += len(line)
        return line

    def _delimiter_line(self, line: bytes | None = None) -> bool:
        """Check one delimiter line (``line``, or the next one read): True for a part's, False
        for the close delimiter."""
        if line is None:
            line = self._readline(self._line_limit)
        if not line:
            raise BodyEnded()
        if not line.startswith(self._delimiter):
            raise FramingError(f"{line[:80]!r} where the multipart delimiter was due")
        rest = line[len(self._delimiter) :]
        close = rest.startswith(b"--")
        if close:
            rest = rest[2:]
        if not _PADDING.fullmatch(rest):
            raise FramingError(f"{line[:80]!r} where the multipart delimiter was due")
        ended = rest.endswith(b"\n")
        if not ended:
            if len(line) >= self._line_limit:
                raise FramingError(f"a multipart delimiter line longer than {self._line_limit} bytes")
            if not close:
                raise BodyEnded()
        return not close

    def _after_data(self) -> None:
        """The line end that ends a part's data (it belongs to the next delimiter)."""
        crlf = self._readline(2)
        if not crlf:
            raise BodyEnded()
        if crlf != b"\r\n":
            raise FramingError(
                f"{crlf!r} after a part's data, where the multipart delimiter was due (a part "
                "longer or shorter than its Content-Range)"
            )

    def next_part(self) -> tuple[int, int, int]:
        """The next part's ``Content-Range`` as ``(first, last, size)``, its headers read; its data
        comes next. ``FramingError`` when the answer has no further part or a malformed one."""
        budget = MAX_PART_HEADER_BYTES
        if self._first:
            self._first = False
            line = self._readline(self._line_limit)
            while line in (b"\r\n", b"\n"):  # blank lines before the first delimiter (nginx sends one)
                budget -= len(line)
                if budget <= 0:
                    raise FramingError(f"more than {MAX_PART_HEADER_BYTES} bytes before the first part")
                line = self._readline(self._line_limit)
            is_part = self._delimiter_line(line)
        else:
            self._after_data()
            is_part = self._delimiter_line()
        if not is_part:
            raise FramingError(f"the answer ends after {self.parts} parts: a part asked for is missing")
        self.parts += 1
        found: tuple[int, int, int] | None = None
        seen = False
        while True:
            line = self._readline(budget + 1)
            budget -= len(line)
            if not line.endswith(b"\n"):
                if budget < 0:
                    raise FramingError(f"part headers longer than {MAX_PART_HEADER_BYTES} bytes")
                raise BodyEnded()
            if budget < 0:
                raise FramingError(f"part headers longer than {MAX_PART_HEADER_BYTES} bytes")
            text = line.rstrip(b"\r\n")
            if not text:
                break
            name, colon, value = text.partition(b":")
            if not colon or not name or name[:1] in (b" ", b"\t"):
                raise FramingError(f"a malformed part header line {text[:80]!r}")
            if name.strip().lower() == b"content-range":
                if seen:
                    raise FramingError("a part with two Content-Range headers")
                seen = True
                found = content_range(value.decode("latin-1"))
                if found is None:
                    raise FramingError(f"a part with Content-Range {value.strip()[:80]!r}")
        if found is None:
            raise FramingError("a part without a Content-Range")
        return found

    def end(self) -> None:
        """The close delimiter after the last part's data (its epilogue is never read)."""
        self._after_data()
        if self._delimiter_line():
            raise FramingError(f"more parts than the {self.parts} asked for")
