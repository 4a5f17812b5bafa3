"""modctl's Modelfile: which files of a context directory to pack as which layer kind, and the
model's config fields, parsed the way modctl parses it (``pkg/modelfile/parser/parser.go``).

A Modelfile is one command per line: ``NAME``, ``ARCH``, ``FAMILY``, ``FORMAT``, ``PARAMSIZE``,
``PRECISION``, ``QUANTIZATION`` set a config field (each at most once); ``CONFIG``, ``MODEL``,
``CODE``, ``DOC``, ``DATASET`` name files by a glob relative to the context directory (repeatable,
deduplicated). Commands are case-insensitive, ``#`` starts a comment line, an argument is one
word or one ``"quoted string"`` and a backslash takes the next character literally. What differs
from modctl is only what makes it safe to read a Modelfile someone else wrote: every input is
bounded, globs and what they match never leave the context directory, and errors name the
1-based line (modctl counts from 0).

The result is a list of ``SelectedFile`` rows and ``PackOptions`` fields; packing them is
``selected_files.build_selected_artifact``.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass, field, replace
from typing import Any

from modelpack.errors import ModelfileError, PackError, UnsafePathError
from modelpack.mediatypes import LayerKind
from modelpack.mediatypes.annotations import safe_relative_path
from modelpack.packing.file_discovery import OTHER_FILE_CHOICES
from modelpack.packing.opened_input import open_beneath
from modelpack.packing.packed_artifact import PackedArtifact, PackOptions
from modelpack.packing.selected_files import SelectedFile, build_selected_artifact, filter_selected
from modelpack.terminal import for_terminal, has_control_characters

#: A Modelfile is a few dozen short lines; these bounds only stop a hostile one.
MAX_MODELFILE_BYTES = 1024 * 1024
#: modctl reads lines with Go's bufio.Scanner, whose default token limit is 64 KiB.
MAX_LINE_BYTES = 64 * 1024
MAX_GLOBS = 1024
MAX_SELECTED_FILES = 100_000
#: directory entries a glob may look at, all globs together (a glob is a walk of the context dir)
MAX_ENTRIES_SCANNED = 1_000_000

#: the glob commands and the layer kind each gives (modctl: pkg/backend/build.go getProcessors)
GLOB_KINDS = {
    "CONFIG": LayerKind.WEIGHT_CONFIG,
    "MODEL": LayerKind.WEIGHT,
    "CODE": LayerKind.CODE,
    "DOC": LayerKind.DOC,
    "DATASET": LayerKind.DATASET,
}
#: the field commands and the PackOptions field each sets (modctl: BuildModelConfig)
FIELD_OPTIONS = {
    "NAME": "name",
    "ARCH": "architecture",
    "FAMILY": "family",
    "FORMAT": "model_format",
    "PARAMSIZE": "param_size",
    "PRECISION": "precision",
    "QUANTIZATION": "quantization",
}
#: modctl's order (pkg/modelfile/command/command.go ``Commands``)
COMMANDS = ("CONFIG", "MODEL", "CODE", "DATASET", "DOC", *FIELD_OPTIONS)
_MAGIC = frozenset("*?[")
_NAME_RE = re.compile(r"[^A-Za-z0-9._-]+")


@dataclass(frozen=True)
class ModelfileGlob:
    command: str
    pattern: str
    line: int  # 1-based


@dataclass
class Modelfile:
    path: str
    globs: list[ModelfileGlob] = field(default_factory=list)
    fields: dict[str, str] = field(default_factory=dict)  # command → value
    lines: dict[str, int] = field(default_factory=dict)  # field command → its line

    def pack_options(self, opts: PackOptions) -> PackOptions:
        """``opts`` with the Modelfile's fields filled in; a flag given on the command line wins."""
        changes: dict[str, Any] = {
            option: self.fields[cmd]
            for cmd, option in FIELD_OPTIONS.items()
            if cmd in self.fields and getattr(opts, option) is None
        }
        return replace(opts, **changes)


def read_modelfile(path: str) -> Modelfile:
    """Parse the Modelfile at ``path`` (read at most ``MAX_MODELFILE_BYTES`` + 1 bytes)."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_MODELFILE_BYTES + 1)
    except OSError as exc:
        raise ModelfileError(path, f"cannot read: {exc.strerror or exc}") from None
    return parse_modelfile(data, path)


def parse_modelfile(data: bytes, path: str = "Modelfile") -> Modelfile:
    """A Modelfile's bytes → its globs and fields, as modctl's parser reads them, bounded."""
    if len(data) > MAX_MODELFILE_BYTES:
        raise ModelfileError(path, f"larger than {MAX_MODELFILE_BYTES} bytes; refusing to parse it")
    mf = Modelfile(path)
    seen: set[tuple[str, str]] = set()
    raw_lines = data.split(b"\n")
    if raw_lines and raw_lines[-1] == b"":
        raw_lines.pop()
    for number, raw in enumerate(raw_lines, start=1):
        if len(raw) > MAX_LINE_BYTES:
            raise ModelfileError(path, f"line longer than {MAX_LINE_BYTES} bytes", line=number)
        if raw.endswith(b"\r"):
            raw = raw[:-1]  # bufio.ScanLines drops a CR before the LF
        try:
            text = raw.decode("utf-8").strip()
        except UnicodeDecodeError:
            raise ModelfileError(path, "not UTF-8", line=number) from None
        if not text or text.startswith("#"):
            continue
        command, value = _parse_line(text, path, number)
        if command in GLOB_KINDS:
            if (command, value) in seen:
                continue  # modctl keeps each glob of a command once
            seen.add((command, value))
            if len(mf.globs) == MAX_GLOBS:
                raise ModelfileError(path, f"more than {MAX_GLOBS} file globs", line=number)
            _check_pattern(value, path, number)
            mf.globs.append(ModelfileGlob(command, value, number))
        else:
            if command in mf.fields:
                raise ModelfileError(
                    path,
                    f"duplicate {command} command (first on line {mf.lines[command]})",
                    line=number,
                )
            mf.fields[command] = value
            mf.lines[command] = number
    return mf


def _parse_line(text: str, path: str, number: int) -> tuple[str, str]:
    """One command line → (COMMAND, its single argument), modctl's ``splitCommand`` + ``parseArgs``."""
    if not any(text.upper().startswith(cmd) for cmd in COMMANDS):
        raise ModelfileError(path, f"unknown command: {for_terminal(text[:80])}", line=number)
    space = text.find(" ")
    if space < 0:
        raise ModelfileError(path, f"{for_terminal(text[:80])}: a command takes one argument", line=number)
    command = text[:space].strip().upper()
    if command not in COMMANDS:
        raise ModelfileError(
            path,
            f"unknown command {for_terminal(command[:40])!s} (known: {', '.join(COMMANDS)})",
            line=number,
        )
    args = split_args(text[space + 1 :].strip(), path, number)
    if len(args) != 1:
        raise ModelfileError(
            path,
            f"{command} takes one argument, got {len(args)} (quote a value with spaces: "
            f'{command} "a b"; comments are whole lines)',
            line=number,
        )
    if not args[0]:
        raise ModelfileError(path, f"{command}: empty argument", line=number)
    if has_control_characters(args[0]):
        raise ModelfileError(path, f"{command}: the argument contains a control character", line=number)
    return command, args[0]


def split_args(text: str, path: str, number: int) -> list[str]:
    """modctl's ``parseArgs``: words split on space/tab, ``"…"`` keeps spaces, ``\\`` escapes."""
    args: list[str] = []
    current: list[str] = []
    in_quotes = escape = had_quotes = False
    for ch in text:
        if escape:
            current.append(ch)
            escape = False
        elif ch == "\\":
            escape = True
        elif ch == '"':
            in_quotes = not in_quotes
            had_quotes = True
        elif ch in " \t" and not in_quotes:
            if current or had_quotes:
                args.append("".join(current))
                current = []
                had_quotes = False
        else:
            current.append(ch)
    if in_quotes:
        raise ModelfileError(path, "unclosed quotes", line=number)
    if current or had_quotes:
        args.append("".join(current))
    return args


def _check_pattern(pattern: str, path: str, number: int) -> None:
    """A glob names files inside the context directory: relative, no ``..``, no empty component."""
    try:
        safe_relative_path(pattern, what="glob")
    except UnsafePathError as exc:
        raise ModelfileError(
            path, f"{exc}; globs are relative to the context directory", line=number
        ) from None
    parts = pattern.split("/")
    if any(p in ("", ".") for p in parts):
        raise ModelfileError(path, f"glob {pattern!r} has an empty or '.' path component", line=number)
    for part in parts:
        try:
            glob_component_regex(part)
        except BadPatternError as exc:
            raise ModelfileError(path, f"bad glob (Go filepath.Match syntax): {exc}", line=number) from None


class BadPatternError(ValueError):
    """A glob Go's ``filepath.Match`` refuses (``ErrBadPattern``): modctl fails on it too."""


def glob_component_regex(part: str) -> re.Pattern[str]:
    """One path component of a glob, matched as Go's ``filepath.Match`` matches it: ``*`` any run
    of characters, ``?`` one, ``[…]`` a class of characters or ``a-z`` ranges, ``[^…]`` negated
    (``!`` is an ordinary character there, unlike Python's fnmatch). A class that is empty or not
    closed, or a range ending in ``]`` or starting with ``-``, raises ``BadPatternError``."""
    out: list[str] = []
    i, n = 0, len(part)
    while i < n:
        c = part[i]
        if c == "*":
            out.append(".*")
        elif c == "?":
            out.append(".")
        elif c == "[":
            j = i + 1
            negate = j < n and part[j] == "^"
            j += negate
            ranges: list[str] = []
            while True:
                if j >= n:
                    raise BadPatternError(f"{part!r}: '[' is not closed")
                if part[j] == "]" and ranges:
                    break
                lo = part[j]
                if lo in "-]":
                    raise BadPatternError(f"{part!r}: {lo!r} cannot start a character range")
                hi = lo
                if j + 1 < n and part[j + 1] == "-":
                    if j + 2 >= n or part[j + 2] in "-]":
                        raise BadPatternError(f"{part!r}: a range has no end")
                    hi = part[j + 2]
                    if hi < lo:
                        raise BadPatternError(f"{part!r}: range {lo}-{hi} is reversed")
                    j += 2
                ranges.append(re.escape(lo) if lo == hi else f"{re.escape(lo)}-{re.escape(hi)}")
                j += 1
            out.append("[" + ("^" if negate else "") + "".join(ranges) + "]")
            i = j
        else:
            out.append(re.escape(c))
        i += 1
    return re.compile("".join(out) + r"\Z", re.DOTALL)


class _Walk:
    """Expands the globs inside ``root`` without following a link out of it."""

    def __init__(self, root: str, path: str) -> None:
        self.root = root
        self.path = path
        self.scanned = 0

    def inside(self, full: str, glob: ModelfileGlob) -> str:
        real = os.path.realpath(full)
        if os.path.commonpath([self.root, real]) != self.root:
            raise ModelfileError(
                self.path,
                f"{glob.command} {glob.pattern!r}: {full} is a symlink leaving the context directory "
                f"(→ {real}); refusing it",
                line=glob.line,
            )
        return real

    def listdir(self, directory: str, glob: ModelfileGlob) -> list[str]:
        try:
            names = sorted(os.listdir(directory))
        except OSError:
            return []  # Go's Glob ignores I/O errors: an unreadable directory matches nothing
        self.scanned += len(names)
        if self.scanned > MAX_ENTRIES_SCANNED:
            raise ModelfileError(
                self.path,
                f"{glob.command} {glob.pattern!r}: the globs looked at more than "
                f"{MAX_ENTRIES_SCANNED} directory entries; write narrower globs",
                line=glob.line,
            )
        return names

    def expand(self, glob: ModelfileGlob) -> list[tuple[str, str]]:
        """(relpath, absolute path of the bytes) of the regular files ``glob`` matches."""
        parts = glob.pattern.split("/")
        current = [("", self.root)]  # (relpath so far, directory)
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            found: list[tuple[str, str]] = []
            for rel, directory in current:
                if _MAGIC.isdisjoint(part):
                    names = [part]
                else:
                    rx = glob_component_regex(part)
                    names = [n for n in self.listdir(directory, glob) if rx.match(n)]
                for name in names:
                    full = os.path.join(directory, name)
                    if not os.path.lexists(full):
                        continue
                    child_rel = f"{rel}/{name}" if rel else name
                    real = self.inside(full, glob)
                    if not last:
                        if os.path.isdir(real):
                            found.append((child_rel, full))
                        continue
                    found.append((child_rel, real))
            current = found
        out = []
        literal = _MAGIC.isdisjoint(glob.pattern)
        for rel, real in current:
            try:
                st = os.stat(real)
            except OSError as exc:
                raise ModelfileError(
                    self.path,
                    f"{glob.command} {glob.pattern!r}: {rel}: {exc.strerror or exc} (a dangling symlink?)",
                    line=glob.line,
                ) from None
            if stat.S_ISDIR(st.st_mode):
                if literal:
                    raise ModelfileError(
                        self.path,
                        f"{glob.command} {glob.pattern!r} is a directory; name its files "
                        f"(e.g. {glob.pattern}/*), as modctl asks too",
                        line=glob.line,
                    )
                continue  # a wildcard selects files; directories it matches are passed over
            if not stat.S_ISREG(st.st_mode):
                raise ModelfileError(
                    self.path,
                    f"{glob.command} {glob.pattern!r}: {rel} is not a regular file (device, FIFO or socket)",
                    line=glob.line,
                )
            try:
                rel.encode("utf-8")
                safe_relative_path(rel, what="file path")
            except UnicodeEncodeError:
                raise ModelfileError(
                    self.path,
                    f"{glob.command} {glob.pattern!r}: file name {rel!r} is not UTF-8",
                    line=glob.line,
                ) from None
            except UnsafePathError as exc:
                raise ModelfileError(self.path, str(exc), line=glob.line) from None
            out.append((rel, real))
        if literal and not out:
            raise ModelfileError(
                self.path,
                f"{glob.command} {glob.pattern!r}: no such file in the context directory {self.root}",
                line=glob.line,
            )
        return out


def select_files(mf: Modelfile, context_dir: str) -> list[SelectedFile]:
    """The files the Modelfile's globs name, each with its command's layer kind.

    A file two commands of different kinds name is refused (it would be two layers at one path);
    a glob matching nothing is allowed, as in modctl, but a literal path must exist.
    """
    root = os.path.realpath(context_dir)
    if not os.path.isdir(root):
        raise ModelfileError(mf.path, f"context directory {context_dir} is not a directory")
    walk = _Walk(root, mf.path)
    chosen: dict[str, tuple[SelectedFile, ModelfileGlob]] = {}
    for glob in mf.globs:
        kind = GLOB_KINDS[glob.command]
        for rel, real in walk.expand(glob):
            before = chosen.get(rel)
            if before is not None:
                if before[0].kind is not kind:
                    raise ModelfileError(
                        mf.path,
                        f"{rel} is named by {glob.command} {glob.pattern!r} and by "
                        f"{before[1].command} {before[1].pattern!r} (line {before[1].line}); "
                        "a file is one layer of one kind",
                        line=glob.line,
                    )
                continue
            untested = kind is LayerKind.WEIGHT and not rel.endswith(".safetensors")
            try:  # opened once now; every byte packed is read from this descriptor
                opened = open_beneath(root, rel, link_roots=[root], shown=real)
            except PackError as exc:
                raise ModelfileError(
                    mf.path, f"{glob.command} {glob.pattern!r}: {exc}", line=glob.line
                ) from None
            chosen[rel] = (SelectedFile(rel, real, kind, untested, source=opened), glob)
            if len(chosen) > MAX_SELECTED_FILES:
                raise ModelfileError(mf.path, f"the globs select more than {MAX_SELECTED_FILES} files")
    if not chosen:
        raise ModelfileError(mf.path, f"the globs select no file in {root}")
    return [sel for sel, _ in chosen.values()]


def build_modelfile_artifact(
    context_dir: str, modelfile: str, opts: PackOptions | None = None
) -> PackedArtifact:
    """Pack the files ``modelfile`` names in ``context_dir``, with its fields as the config's.

    ``--include``/``--exclude`` filter what the globs selected; ``--max-file-size`` and the image
    format are not combined with a Modelfile (refused, naming the flag).
    """
    opts = opts or PackOptions()
    mf = read_modelfile(modelfile)
    if opts.max_file_size:
        raise ModelfileError(modelfile, "--max-file-size is not supported with --modelfile")
    merged = mf.pack_options(opts)
    merged.check(OTHER_FILE_CHOICES)
    selected = filter_selected(select_files(mf, context_dir), merged)
    if not selected:
        raise ModelfileError(modelfile, "--include/--exclude left no file of the Modelfile's globs")
    root = os.path.realpath(context_dir)
    default = _NAME_RE.sub("-", os.path.basename(root)) or "model"
    return build_selected_artifact(selected, merged, default_name=default, name=f"modelfile:{modelfile}")


__all__ = [
    "COMMANDS",
    "FIELD_OPTIONS",
    "GLOB_KINDS",
    "MAX_GLOBS",
    "MAX_LINE_BYTES",
    "MAX_MODELFILE_BYTES",
    "Modelfile",
    "ModelfileGlob",
    "build_modelfile_artifact",
    "parse_modelfile",
    "read_modelfile",
    "select_files",
    "split_args",
]
