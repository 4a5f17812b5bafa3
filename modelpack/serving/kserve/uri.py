"""Storage URIs the initializer accepts, as KServe passes them (``SRC_URI`` of each argv pair).

- ``modelpack://HOST[:PORT]/REPO(:TAG|@sha256:…)`` — a registry repository: the prefix the
  ClusterStorageContainers match (KServe routes ``oci://`` to its own modelcar, image-volume
  and fetch modes in the webhook, never to a ClusterStorageContainer of an InferenceService);
- ``oci://HOST[:PORT]/REPO…`` — the same, for a LocalModelCache whose download Job a
  ``localModelDownloadJob`` ClusterStorageContainer serves;
- ``oci:DIR[:TAG|@sha256:…]`` — an OCI image layout directory (a mounted volume);
- ``s3://BUCKET/PREFIX[:TAG|@sha256:…]`` — an OCI layout in a bucket.

A registry URI must name its host (no implicit Docker Hub: a URI from an InferenceService
author never reaches a registry it did not name).
"""

from __future__ import annotations

from dataclasses import dataclass

from modelpack.errors import InvalidReferenceError
from modelpack.oci.reference import Reference, parse_reference

MODELPACK_SCHEME = "modelpack://"
OCI_REGISTRY_SCHEME = "oci://"


@dataclass(frozen=True)
class StorageUri:
    """One ``SRC_URI``: what it said and the reference it names."""

    text: str
    reference: Reference

    @property
    def is_registry(self) -> bool:
        return self.reference.scheme == "registry"


def parse_storage_uri(text: str) -> StorageUri:
    """``SRC_URI`` → the reference it names; ``InvalidReferenceError`` for anything else."""
    for prefix in (MODELPACK_SCHEME, OCI_REGISTRY_SCHEME):
        if text.startswith(prefix):
            rest = text[len(prefix) :]
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
    if text.startswith(("oci:", "s3://")) and not text.startswith(OCI_REGISTRY_SCHEME):
        return StorageUri(text, parse_reference(text))
    raise InvalidReferenceError(
        f"{text!r}: not a modelpack storage URI (modelpack://HOST/REPO:TAG|@sha256:…, oci://HOST/REPO…, "
        "oci:DIR[:TAG], s3://BUCKET/PREFIX[:TAG])"
    )
