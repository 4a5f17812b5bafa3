"""Pack a Hugging Face repository: ``hf://ORG/NAME[@REVISION]`` through huggingface_hub's cache.

``snapshot_download`` does what users expect of it (``HF_TOKEN``, ``HF_ENDPOINT``,
``HF_HUB_OFFLINE``, the cache under ``HF_HOME``/``HF_HUB_CACHE``) and returns the snapshot
directory ``models--ORG--NAME/snapshots/<commit>``, whose files are relative symlinks into the
repository's ``blobs/``. The pack reads the blobs through those links — nothing is copied a second
time — and records the commit and the repository URL in ``descriptor.revision`` and
``descriptor.sourceURL``. The same commit packs to the same manifest digest: files are classified
by name as a directory pack does, and every file is recorded with mode 0644 (a blob's own mode is
the downloader's umask, not the repository's).

Who controls what: the Hub (or whatever ``HF_ENDPOINT`` names) and anyone who can write the cache
control file names, link targets, sizes and bytes. So the snapshot directory must be
``snapshots/<40-hex commit>`` of this repository's cache folder (a ``refs/`` file is data and
could point anywhere), each link must resolve to a regular file directly in this repository's
``blobs/`` (else it is refused, naming it), every path is checked like any artifact path, and every
file is hashed: an LFS blob's name is its sha256, which is compared with the hash afterwards and
a mismatch refused (a corrupted or forged cache), never used instead of hashing.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from modelpack.boundedjson import loads
from modelpack.errors import (
    HFRevisionNotFoundError,
    HFSourceError,
    ModelpackError,
    PackError,
    UnsafePathError,
)
from modelpack.mediatypes import LayerKind
from modelpack.mediatypes.annotations import safe_relative_path
from modelpack.packing.file_discovery import OTHER_FILE_CHOICES, classify
from modelpack.packing.opened_input import InputFile, open_beneath
from modelpack.packing.packed_artifact import PackedArtifact, PackOptions
from modelpack.packing.selected_files import SelectedFile, build_selected_artifact, filter_selected
from modelpack.terminal import for_terminal, has_control_characters

HF_SCHEME = "hf://"
#: huggingface_hub's repo id rule: letters, digits, ``-_.``, no ``--``/``..``, at most 96 characters
_REPO_PART = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
MAX_REVISION = 256
#: files a snapshot may hold (the largest public repos hold a few thousand)
MAX_SNAPSHOT_FILES = 100_000
#: what a pack records for every file of a snapshot (see the module docstring)
SNAPSHOT_FILE_MODE = 0o644
INSTALL_HINT = "pip install 'modelpack-oci[hf]'"


@dataclass(frozen=True)
class HFSource:
    """A parsed ``hf://ORG/NAME[@REVISION]``; ``revision`` None means the default branch."""

    repo_id: str
    revision: str | None = None

    @property
    def shown(self) -> str:
        """The source as a person wrote it, the revision escaped (it is data from outside)."""
        rev = f"@{for_terminal(self.revision)}" if self.revision else ""
        return f"{HF_SCHEME}{self.repo_id}{rev}"

    @property
    def name(self) -> str:
        return self.repo_id.split("/", 1)[1]


def is_hf_url(text: object) -> bool:
    return isinstance(text, str) and text.startswith(HF_SCHEME)


def parse_hf_url(url: str) -> HFSource:
    """``hf://ORG/NAME[@REVISION]`` → ``HFSource``; anything else raises ``HFSourceError``."""
    if not is_hf_url(url):
        raise HFSourceError(f"{for_terminal(url)!s} is not an hf://ORG/NAME[@REVISION] source")
    body = url[len(HF_SCHEME) :]
    repo_id, at, revision = body.partition("@")
    parts = repo_id.split("/")
    if len(parts) != 2 or not all(_REPO_PART.match(p) and "--" not in p and ".." not in p for p in parts):
        raise HFSourceError(
            f"hf://{for_terminal(repo_id)}: not a Hugging Face repository id ORG/NAME (letters, digits, "
            "'-', '_', '.'; no '--' or '..'; at most 96 characters each)",
            repo_id=repo_id,
        )
    if at:
        _check_revision(repo_id, revision)
    return HFSource(repo_id, revision if at else None)


def _check_revision(repo_id: str, revision: str) -> None:
    """A revision names a commit, branch or tag; huggingface_hub joins it onto ``refs/``, so a
    revision that is not a plain ref name (``..``, absolute, control characters) is refused."""
    problem = None
    if not revision:
        problem = "is empty"
    elif len(revision) > MAX_REVISION:
        problem = f"is longer than {MAX_REVISION} characters"
    elif has_control_characters(revision):
        problem = "contains a control character"
    elif (
        revision.startswith("/") or "\\" in revision or any(p in ("", ".", "..") for p in revision.split("/"))
    ):
        problem = "is not a ref name (absolute, '.', '..', an empty component or a backslash)"
    if problem:
        raise HFSourceError(
            f"hf://{repo_id}: revision {for_terminal(revision[:MAX_REVISION])!r} {problem}",
            repo_id=repo_id,
            revision=revision,
        )


def _hub() -> Any:
    try:
        import huggingface_hub
    except ImportError:
        raise HFSourceError(f"hf:// sources need huggingface_hub: {INSTALL_HINT}") from None
    return huggingface_hub


def _public_url(endpoint: str, repo_id: str) -> str:
    """The repository's URL on the endpoint, without any user:password or query in the endpoint."""
    parts = urlsplit(endpoint.rstrip("/"))
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit((parts.scheme, netloc, f"{parts.path}/{repo_id}", "", ""))


def download_snapshot(
    source: HFSource, *, cache_dir: str | None = None, local_files_only: bool = False
) -> tuple[str, str, str]:
    """(snapshot directory, commit, the repository's cache folder), fetched or found by huggingface_hub.

    ``cache_dir`` None is huggingface_hub's own (``HF_HUB_CACHE``, ``HF_HOME``); with
    ``HF_HUB_OFFLINE=1`` or ``local_files_only`` only the cache is read.
    """
    hub = _hub()
    from huggingface_hub import constants
    from huggingface_hub.utils import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    cache = os.path.abspath(cache_dir or constants.HF_HUB_CACHE)
    revision = source.revision or "main"
    where = f"{source.shown} (revision {for_terminal(revision)!r})"
    # huggingface_hub >= 2 tells an interrupted download from a missing revision
    incomplete: Any = getattr(getattr(hub, "errors", None), "IncompleteSnapshotError", ())
    try:
        path = hub.snapshot_download(
            source.repo_id, revision=revision, cache_dir=cache, local_files_only=local_files_only
        )
    except incomplete:
        raise HFRevisionNotFoundError(
            f"{where}: the cached snapshot in {cache} is incomplete (an interrupted download?) and the "
            "Hub was not asked; download it again online",
            repo_id=source.repo_id,
            revision=revision,
        ) from None
    except (LocalEntryNotFoundError, RevisionNotFoundError) as exc:
        raise HFRevisionNotFoundError(
            f"{where}: not in the Hugging Face cache {cache}, and the Hub was not asked or does not have "
            f"it ({type(exc).__name__}); download it online first, or check the revision",
            repo_id=source.repo_id,
            revision=revision,
        ) from None
    except (RepositoryNotFoundError, GatedRepoError) as exc:
        raise HFSourceError(
            f"{where}: the Hub refused the repository ({type(exc).__name__}: not found, private or "
            "gated; HF_TOKEN must grant access)",
            repo_id=source.repo_id,
            revision=revision,
        ) from None
    except (EntryNotFoundError, HfHubHTTPError, HFValidationError, OSError, ValueError) as exc:
        # ValueError: huggingface_hub refusing what the endpoint sent (a file name with '..', …)
        raise HFSourceError(
            f"{where}: huggingface_hub failed: {type(exc).__name__}: {for_terminal(str(exc)[:300])}",
            repo_id=source.repo_id,
            revision=revision,
        ) from None
    storage = os.path.realpath(os.path.join(cache, "models--" + source.repo_id.replace("/", "--")))
    snapshot = os.path.realpath(path)
    commit = os.path.basename(snapshot)
    if os.path.dirname(snapshot) != os.path.join(storage, "snapshots") or not _COMMIT.match(commit):
        raise HFSourceError(
            f"{where}: the cache gave {for_terminal(snapshot)!r}, not a snapshot directory "
            f"{storage}/snapshots/<commit> (a refs/ file pointing elsewhere?); refusing it",
            repo_id=source.repo_id,
            revision=revision,
        )
    return snapshot, commit, storage


def list_snapshot(
    source: HFSource, snapshot: str, storage: str, other_files: str = LayerKind.DOC
) -> list[SelectedFile]:
    """The snapshot's files, each read through its link from the repository's ``blobs/``."""
    blobs = os.path.join(storage, "blobs")
    out: list[SelectedFile] = []
    for dirpath, dirnames, filenames in os.walk(snapshot, followlinks=False):
        dirnames.sort()
        for d in list(dirnames):
            full = os.path.join(dirpath, d)
            if os.path.islink(full):
                raise HFSourceError(
                    f"{source.shown}: {_rel(full, snapshot)!r} in the cache is a symlinked directory "
                    f"(→ {for_terminal(os.readlink(full))!r}); huggingface_hub writes none; refusing it",
                    repo_id=source.repo_id,
                )
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for fname in sorted(filenames):
            if fname.startswith("."):
                continue  # .gitattributes and other hidden files, as a directory pack skips them
            full = os.path.join(dirpath, fname)
            rel = _rel(full, snapshot)
            try:
                rel.encode("utf-8")
                safe_relative_path(rel, what="file path")
            except UnicodeEncodeError:
                raise HFSourceError(
                    f"{source.shown}: file name {rel!r} is not UTF-8; refusing it", repo_id=source.repo_id
                ) from None
            except UnsafePathError as exc:
                raise HFSourceError(f"{source.shown}: {exc}", repo_id=source.repo_id) from None
            real = _blob_of(source, full, rel, blobs, snapshot)
            kind, untested = classify(rel, other_files)
            if kind is None:
                raise PackError(
                    f"{source.shown}: {rel}: not a recognised model file and --other-files=refuse"
                )
            opened = _open_blob(source, snapshot, rel, blobs, real)
            out.append(SelectedFile(rel, real, kind, untested, mode=SNAPSHOT_FILE_MODE, source=opened))
            if len(out) > MAX_SNAPSHOT_FILES:
                raise HFSourceError(
                    f"{source.shown}: more than {MAX_SNAPSHOT_FILES} files", repo_id=source.repo_id
                )
    return out


def _rel(full: str, snapshot: str) -> str:
    return os.path.relpath(full, snapshot).replace(os.sep, "/")


def _blob_of(source: HFSource, full: str, rel: str, blobs: str, snapshot: str) -> str:
    """Where ``full``'s bytes are: a regular file directly in ``blobs/`` (through a symlink, as
    huggingface_hub writes it) or a regular file in the snapshot itself; anything else is refused."""
    st = os.lstat(full)
    if stat.S_ISLNK(st.st_mode):
        target = os.readlink(full)
        real = os.path.realpath(full)
        if os.path.dirname(real) != blobs:
            raise HFSourceError(
                f"{source.shown}: {rel!r} is a symlink to {for_terminal(target)!r}, outside the "
                f"repository's blobs directory {blobs}; refusing it",
                repo_id=source.repo_id,
            )
        try:
            st = os.stat(real)
        except OSError:
            raise HFSourceError(
                f"{source.shown}: {rel!r} links to a missing blob {for_terminal(target)!r}; "
                "the cache is incomplete (download it again)",
                repo_id=source.repo_id,
            ) from None
    else:
        real = full
        if os.path.commonpath([snapshot, os.path.realpath(full)]) != snapshot:
            raise HFSourceError(f"{source.shown}: {rel!r} leaves the snapshot", repo_id=source.repo_id)
    if not stat.S_ISREG(st.st_mode):
        raise HFSourceError(
            f"{source.shown}: {rel!r} is not a regular file in the cache; refusing it", repo_id=source.repo_id
        )
    return real


def _open_blob(source: HFSource, snapshot: str, rel: str, blobs: str, real: str) -> InputFile:
    """Open ``rel`` once, beneath the snapshot, its link followed only into ``blobs/`` (the path
    checked above is a name another user of the cache can re-point; the descriptor is not)."""
    try:
        opened = open_beneath(snapshot, rel, link_roots=[blobs], shown=real)
    except PackError as exc:
        raise HFSourceError(f"{source.shown}: {rel!r}: {exc}", repo_id=source.repo_id) from None
    where = os.path.dirname(opened.resolved)
    if where != blobs and not opened.resolved.startswith(snapshot + os.sep):
        opened.close()
        raise HFSourceError(
            f"{source.shown}: {rel!r} resolves to {for_terminal(opened.resolved)!r}, not a file directly "
            f"in the repository's blobs directory {blobs}; refusing it",
            repo_id=source.repo_id,
        )
    return opened


#: the per-commit listing huggingface_hub (>= 2) caches beside the snapshots
MAX_TREE_LISTING_BYTES = 64 * 1024 * 1024


def check_snapshot_complete(source: HFSource, snapshot: str, storage: str, commit: str) -> None:
    """Offline, only the cache's own listing of the commit (``trees/<commit>.json``, written when
    the snapshot was downloaded online) shows that the snapshot holds every file of the commit; a
    cache filled file by file (``hf_hub_download``) has none. Without it, or with a listed file
    missing, the pack is refused: it would record the full commit as ``descriptor.revision``."""
    listing = os.path.join(storage, "trees", f"{commit}.json")
    how = (
        "download the snapshot online once (snapshot_download / `hf download ORG/NAME`, "
        "huggingface_hub >= 2 caches the listing), or pack the files as a directory"
    )
    try:
        with open(listing, "rb") as f:
            data = f.read(MAX_TREE_LISTING_BYTES + 1)
        doc = loads(data, what=listing, max_bytes=MAX_TREE_LISTING_BYTES)
    except FileNotFoundError:
        raise HFRevisionNotFoundError(
            f"{source.shown}: offline, and the cache holds no listing of commit {commit} "
            f"(trees/{commit}.json), so nothing shows the cached snapshot is the whole commit; {how}",
            repo_id=source.repo_id,
            revision=commit,
        ) from None
    except (OSError, ModelpackError, ValueError) as exc:
        raise HFSourceError(
            f"{source.shown}: the cache's listing of commit {commit} cannot be read ({exc}); {how}",
            repo_id=source.repo_id,
            revision=commit,
        ) from None
    files = doc.get("files") if isinstance(doc, dict) else None
    if not isinstance(files, dict) or len(files) > MAX_SNAPSHOT_FILES:
        raise HFSourceError(
            f"{source.shown}: {listing} is not a listing of files; {how}",
            repo_id=source.repo_id,
            revision=commit,
        )
    missing = sorted(
        str(rel)
        for rel in files
        if not isinstance(rel, str) or not os.path.lexists(os.path.join(snapshot, *rel.split("/")))
    )
    if missing:
        shown = ", ".join(for_terminal(m) for m in missing[:5]) + (" …" if len(missing) > 5 else "")
        raise HFRevisionNotFoundError(
            f"{source.shown}: offline, the cached snapshot of commit {commit} lacks {len(missing)} of its "
            f"{len(files)} files ({shown}); {how}",
            repo_id=source.repo_id,
            revision=commit,
        )


def build_hf_artifact(
    url: str,
    opts: PackOptions | None = None,
    *,
    cache_dir: str | None = None,
    local_files_only: bool = False,
) -> PackedArtifact:
    """Fetch (or find in the cache) ``hf://ORG/NAME[@REVISION]`` and describe it as an artifact
    whose files are the cache's blobs; ``descriptor.revision`` is the commit, ``sourceURL`` the
    repository's URL on ``HF_ENDPOINT``. Flags (``--name``, …) override as for a directory."""
    opts = opts or PackOptions()
    opts.check(OTHER_FILE_CHOICES)
    if opts.max_file_size:
        raise HFSourceError(f"{url}: --max-file-size is not supported for hf:// sources")
    source = parse_hf_url(url)
    snapshot, commit, storage = download_snapshot(
        source, cache_dir=cache_dir, local_files_only=local_files_only
    )
    from huggingface_hub import constants

    if local_files_only or constants.HF_HUB_OFFLINE:
        check_snapshot_complete(source, snapshot, storage, commit)
    selected = filter_selected(list_snapshot(source, snapshot, storage, opts.other_files), opts)
    if not selected:
        raise HFSourceError(
            f"{source.shown}: no files to pack at commit {commit} (empty, or everything excluded)",
            repo_id=source.repo_id,
            revision=commit,
        )
    merged = replace(
        opts,
        revision=opts.revision or commit,
        source_url=opts.source_url or _public_url(constants.ENDPOINT, source.repo_id),
    )
    artifact = build_selected_artifact(
        selected, merged, default_name=source.name, name=f"{HF_SCHEME}{source.repo_id}@{commit}"
    )
    for f in artifact.files:
        hint = os.path.basename(f.source.resolved if f.source is not None else f.path)
        if _SHA256.match(hint) and hint != f.digest.hex:
            raise HFSourceError(
                f"{source.shown}: {f.relpath} is the blob {hint} (an LFS file's name is its sha256) but "
                f"its bytes hash to {f.digest}; the cache is corrupted or forged; refusing it",
                repo_id=source.repo_id,
                revision=commit,
            )
    return artifact


__all__ = [
    "HF_SCHEME",
    "HFSource",
    "build_hf_artifact",
    "download_snapshot",
    "is_hf_url",
    "list_snapshot",
    "parse_hf_url",
]
