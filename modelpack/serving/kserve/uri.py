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

from modelpack.errors import InvalidReferenceError
from modelpack.oci.reference import Reference, parse_reference

MODELPACK_SCHEME = "modelpack://"
OCI_REGISTRY_SCHEME = "oci://"


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
    return tuple(include), tuple(exclude)


def _parse_body(text: str, body: str) -> StorageUri:
    for prefix in (MODELPACK_SCHEME, OCI_REGISTRY_SCHEME):
        if body.startswith(prefix):
            rest = body[len(prefix) :]
            host = rest.split("/", 1)[0]
            if "/" not in rest or not ("." in host or ":" in host or host == "localhost"):
                raise InvalidReferenceError(
                    f"{text!r}: expected {prefix}HOST[:PORT]/REPO(:TAG|@sha256:…) with the registry "
                    "host named (a dot, a port or localhost)"
                )
            ref = parse_reference(rest)
            if ref.scheme != "registry":
                raise InvalidReferenceError(f"{text!r} does not name a registry repository")
            return StorageUri(text, ref)
    if body.startswith(("oci:", "s3://")) and not body.startswith(OCI_REGISTRY_SCHEME):
        return StorageUri(text, parse_reference(body))
    raise InvalidReferenceError(
        f"{text!r}: not a modelpack storage URI (modelpack://HOST/REPO:TAG|@sha256:…, oci://HOST/REPO…, "
        "oci:DIR[:TAG], s3://BUCKET/PREFIX[:TAG])"
    )
