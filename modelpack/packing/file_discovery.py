"""Which files of a checkpoint directory get packed, and as which kind of layer.

Discovery refuses what must never reach a registry (symlinks out of the checkpoint, devices,
unsafe names); classification maps file names to ModelPack layer kinds, marking guesses so a
consumer can tell a known file from one packed under ``--other-files``.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence

from modelpack.errors import PackError, UnsafePathError
from modelpack.file_selection import matches_pattern
from modelpack.mediatypes import LayerKind
from modelpack.mediatypes.annotations import safe_relative_path

WEIGHT_CONFIG_NAMES = {
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.json",
    "chat_template.jinja",
    "preprocessor_config.json",
    "processor_config.json",
    "spiece.model",
}
OTHER_WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".gguf", ".onnx", ".h5", ".msgpack")
#: PyTorch pickle formats: loading one (``torch.load`` without ``weights_only``) runs its code
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
DOC_PREFIXES = ("readme", "license", "licence", "notice", "copying", "use_policy")
#: what ``--other-files`` may name: a kind for the files no rule classifies, or refusing them
OTHER_FILE_CHOICES = (*(str(k) for k in (LayerKind.DOC, LayerKind.DATASET, LayerKind.CODE)), "refuse")


def classify(relpath: str, other: str = LayerKind.DOC) -> tuple[LayerKind | None, bool]:
    """Layer kind for a file, and whether the choice is a guess (``…mediatype.untested``).

    Returns (None, _) for a file that ``other == "refuse"`` rejects.
    """
    name = os.path.basename(relpath)
    lower = name.lower()
    if lower.endswith(".safetensors"):
        return LayerKind.WEIGHT, False
    if lower in WEIGHT_CONFIG_NAMES or lower.endswith(".index.json"):
        return LayerKind.WEIGHT_CONFIG, False
    if lower.endswith(OTHER_WEIGHT_SUFFIXES):
        return LayerKind.WEIGHT, True
    if lower.endswith(".md") or lower.startswith(DOC_PREFIXES):
        return LayerKind.DOC, False
    if lower.endswith(".py"):
        return LayerKind.CODE, False
    if other == "refuse":
        return None, True
    return LayerKind(other), True


def pickle_warning(relpath: str) -> str | None:
    """The warning a pack gives for a pickle weight file, None for any other file."""
    if not relpath.lower().endswith(PICKLE_SUFFIXES):
        return None
    return (
        f"{relpath}: a PyTorch pickle file, packed as an untested weight layer; loading it "
        "(torch.load without weights_only) runs code its maker chose; prefer safetensors"
    )


def discover_files(
    root: str,
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
    *,
    skipped: list[str] | None = None,
) -> list[tuple[str, str]]:
    """(relpath, absolute path) of the regular files to pack, sorted by path parts.

    Refuses symlinks that leave ``root``, special files (devices, FIFOs, sockets) and an empty
    result. Hidden entries (``.git``, ``.cache``) are skipped: they are never model content; each
    is appended to ``skipped`` (a directory with a trailing ``/``) so the pack can say so.
    """
    root = os.path.realpath(root)
    if not os.path.isdir(root):
        raise PackError(f"{root}: not a directory")
    out: list[tuple[str, str]] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        if skipped is not None:
            here = os.path.relpath(dirpath, root).replace(os.sep, "/")
            prefix = "" if here == "." else here + "/"
            skipped.extend(
                prefix + n + ("/" if n in dirnames else "")
                for n in sorted((*dirnames, *filenames))
                if n.startswith(".")
            )
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for d in list(dirnames):
            full = os.path.join(dirpath, d)
            if os.path.islink(full):
                target = os.path.realpath(full)
                if os.path.commonpath([root, target]) != root:
                    raise PackError(f"{full}: symlink leaves the checkpoint directory (→ {target})")
                raise PackError(f"{full}: symlinked directories are not packed; copy the directory instead")
        for fname in sorted(filenames):
            if fname.startswith("."):
                continue
            full = os.path.join(dirpath, fname)
            rel = os.path.relpath(full, root).replace(os.sep, "/")
            try:
                safe_relative_path(rel, what="file path")
            except UnsafePathError as exc:
                raise PackError(str(exc)) from exc
            st = os.lstat(full)
            if stat.S_ISLNK(st.st_mode):
                target = os.path.realpath(full)
                if os.path.commonpath([root, target]) != root:
                    raise PackError(f"{full}: symlink leaves the checkpoint directory (→ {target})")
                st = os.stat(full)
                full = target
            if not stat.S_ISREG(st.st_mode):
                raise PackError(f"{full}: not a regular file (device, FIFO or socket); refusing to pack it")
            if include and not matches_pattern(rel, include):
                continue
            if exclude and matches_pattern(rel, exclude):
                continue
            try:
                rel.encode("utf-8")  # the name goes into annotations and JSON: it must be text
            except UnicodeEncodeError:
                raw = os.fsencode(rel)
                raise PackError(
                    f"{os.fsencode(root)!r}: file name {raw!r} is not UTF-8; rename it or --exclude it"
                ) from None
            out.append((rel, full))
    out.sort(key=lambda x: x[0].split("/"))
    if not out:
        raise PackError(f"{root}: no files to pack (empty checkpoint, or everything excluded)")
    return out


__all__ = [
    "OTHER_FILE_CHOICES",
    "PICKLE_SUFFIXES",
    "classify",
    "discover_files",
    "pickle_warning",
]
