"""Storage URIs the initializer accepts, as KServe passes them (``SRC_URI`` of each argv pair).

- ``modelpack://HOST[:PORT]/REPO(:TAG|@sha256:…)`` — a registry repository: the prefix the
  ClusterStorageContainers match (KServe routes ``oci://`` to its own modelcar, image-volume
  and fetch modes in the webhook, never to a ClusterStorageContainer of an InferenceService);
- ``oci://HOST[:PORT]/REPO…`` — the same, for a LocalModelCache whose download Job a
  ``localModelDownloadJob`` ClusterStorageContainer serves;
- ``oci:DIR[:TAG|@sha256:…]`` — an OCI image layout directory (a mounted volume);
- ``s3://BUCKET/PREFIX[:TAG|@sha256:…]`` — an OCI layout in a bucket.

A registry URI must name its host (no implicit Docker Hub: a URI from an InferenceService
author never reaches a registry it did not name). ``?exclude=GLOB`` and ``?include=GLOB``
(repeatable) select files, as ``pull --include/--exclude`` do: an InferenceService whose vLLM
streams the weights from the registry takes only ``?exclude=*.safetensors`` into DEST.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qsl

from modelpack.errors import FileSelectionError, InvalidReferenceError
from modelpack.file_selection import check_patterns
from modelpack.oci.reference import OCI_REGISTRY_SCHEME, Reference, parse_reference

MODELPACK_SCHEME = "modelpack://"


@dataclass(frozen=True)
class StorageUri:
    """One ``SRC_URI``: what it said and the reference it names."""

    text: str
    reference: Reference
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()

    @property
    def selects_files(self) -> bool:
        return bool(self.include or self.exclude)

    @property
    def is_registry(self) -> bool:
        return self.reference.scheme == "registry"


def parse_storage_uri(text: str) -> StorageUri:
    """``SRC_URI`` → the reference it names; ``InvalidReferenceError`` for anything else."""
    body, _, query = text.partition("?")
    include, exclude = _filters(text, query)
    uri = _parse_body(text, body)
    return StorageUri(text, uri.reference, include, exclude)


def _filters(text: str, query: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    include: list[str] = []
    exclude: list[str] = []
    for key, value in parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)):
        if key not in ("include", "exclude") or not value:
            raise InvalidReferenceError(
                f"{text!r}: only ?include=GLOB and ?exclude=GLOB may follow the reference"
            )
        (include if key == "include" else exclude).append(value)
    try:
        check_patterns(include, exclude, names=("?include=", "?exclude="))
    except FileSelectionError as exc:
        raise InvalidReferenceError(f"{text[:200]!r}: {exc}") from None
    return tuple(include), tuple(exclude)


def _parse_body(text: str, body: str) -> StorageUri:
    """``modelpack://`` is this initializer's own spelling of ``oci://``; every other form is
    parsed by ``parse_reference``, so a URI means here what it means to the CLI."""
    if body.startswith(MODELPACK_SCHEME):
        body = OCI_REGISTRY_SCHEME + body[len(MODELPACK_SCHEME) :]
    if body.startswith(("oci:", "s3://")):
        try:
            return StorageUri(text, parse_reference(body))
        except InvalidReferenceError as exc:
            raise InvalidReferenceError(f"{text!r}: {exc}") from exc
    raise InvalidReferenceError(
        f"{text!r}: not a modelpack storage URI (modelpack://HOST/REPO:TAG|@sha256:…, oci://HOST/REPO…, "
        "oci:DIR[:TAG], s3://BUCKET/PREFIX[:TAG])"
    )
