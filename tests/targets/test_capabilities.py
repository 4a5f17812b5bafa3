"""Each backing satisfies exactly the capability Protocols it should, and ``Any`` does not spread.

The copy engine, the puller and the loader choose a path by ``isinstance(target, Capability)``
(``modelpack.targets.base``): a backing that loses or renames a method would silently fall back
to a slower or weaker path (an upload instead of a mount, a copy instead of a receive in place,
no per-source accounting). Real backings are opened here: a distribution registry, an OCI layout
directory, a moto S3 bucket, a checkpoint being packed, the node cache's store.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from modelpack.mount.store import Store

from modelpack.oci.reference import parse_reference
from modelpack.packing.packer import build_artifact
from modelpack.serving.kserve.progress_lines import CountingTarget
from modelpack.targets.base import (
    BlobFiles,
    BlobMounter,
    Catalog,
    CheckedRangeFetcher,
    Closable,
    LocalBlobSource,
    MultiRangeFetcher,
    RangeIntoFetcher,
    ReadableTarget,
    SourceAccounting,
    Target,
    VerifiedSpooler,
)
from modelpack.targets.opener import TargetOptions, open_readable, open_target
from tests.fixtures.registry import RegistryServer
from tests.fixtures.s3 import S3Server
from tests.paths import REPO_ROOT

CAPABILITIES: dict[str, type] = {
    "ReadableTarget": ReadableTarget,
    "Target": Target,
    "LocalBlobSource": LocalBlobSource,
    "BlobFiles": BlobFiles,
    "BlobMounter": BlobMounter,
    "SourceAccounting": SourceAccounting,
    "CheckedRangeFetcher": CheckedRangeFetcher,
    "RangeIntoFetcher": RangeIntoFetcher,
    "MultiRangeFetcher": MultiRangeFetcher,
    "Catalog": Catalog,
    "Closable": Closable,
    "VerifiedSpooler": VerifiedSpooler,
}

#: the project's own source folders (installed as ``modelpack.*``)
SOURCE_ROOTS = ("modelpack", "mediatypes", "signing", "mount", "loader")
#: named parameters annotated exactly ``Any`` (``*args``/``**kwargs`` not counted). Lower it when
#: you give one a real type; never raise it: a new parameter gets the type it has.
MAX_ANY_PARAMETERS = 162


def _capabilities(obj: object) -> set[str]:
    return {name for name, proto in CAPABILITIES.items() if isinstance(obj, proto)}


def test_a_registry_repository_mounts_lists_the_catalog_and_receives_ranges_in_place(
    registry: RegistryServer,
) -> None:
    """A registry target can mount, list the catalog, account bytes per source, fetch checked
    ranges, receive ranges into caller memory and many ranges per request; it keeps no blob as a
    local file."""
    ref = parse_reference(registry.ref("capabilities/registry", "v1"))
    opts = TargetOptions(plain_http=True)
    for target in (open_readable(ref, opts), open_target(ref, opts)):
        assert _capabilities(target) == {
            "ReadableTarget",
            "Target",
            "BlobMounter",
            "SourceAccounting",
            "CheckedRangeFetcher",
            "RangeIntoFetcher",
            "MultiRangeFetcher",
            "Catalog",
            "Closable",
            "VerifiedSpooler",
        }
        assert isinstance(target, BlobMounter) and target.registry_host == registry.host
        assert isinstance(target, SourceAccounting) and target.bytes_by_source() == {}
        assert isinstance(target, MultiRangeFetcher) and target.multi_range  # no mirrors
        assert isinstance(target, Closable)
        target.close()


def test_an_oci_layout_offers_its_blob_files_and_nothing_a_registry_does(tmp_path: Path) -> None:
    """An OCI layout directory hands out local blob sources and blob paths and reads many ranges
    of a blob file at once; it cannot mount, list a catalog or account sources."""
    target = open_target(parse_reference(f"oci:{tmp_path / 'layout'}:v1"), for_write=True)
    assert _capabilities(target) == {
        "ReadableTarget",
        "Target",
        "LocalBlobSource",
        "BlobFiles",
        "MultiRangeFetcher",
    }
    assert isinstance(target, BlobFiles)
    digest = "sha256:" + "0" * 64
    assert target.blob_path(digest) == str(tmp_path / "layout" / "blobs" / "sha256" / ("0" * 64))


def test_an_s3_bucket_is_a_plain_target_that_can_be_closed(s3: S3Server) -> None:
    """An S3 prefix is a read/write target with connections to close, and nothing more."""
    bucket = s3.make_bucket()
    target = open_target(parse_reference(f"s3://{bucket}/models/capabilities:v1"), for_write=True)
    assert _capabilities(target) == {"ReadableTarget", "Target", "Closable"}
    assert isinstance(target, Closable)
    target.close()


def test_a_checkpoint_being_packed_offers_its_files_as_local_blob_sources(checkpoint: Path) -> None:
    """The packer's in-memory artifact offers each file as a local, already hashed blob source."""
    artifact = build_artifact(str(checkpoint))
    assert "LocalBlobSource" in _capabilities(artifact)
    assert isinstance(artifact, LocalBlobSource)
    layer = artifact.manifest.layers[0]
    source = artifact.blob_source(layer)
    assert source.descriptor == layer and source.local_path is not None and source.verified


def test_the_node_cache_store_keeps_blobs_as_files(tmp_path: Path) -> None:
    """The node cache's store is a set of blob files (the loader maps them instead of reading
    ranges); it is not a target."""
    store = Store(str(tmp_path / "cache"))
    assert _capabilities(store) == {"BlobFiles"}


def test_a_counting_wrapper_keeps_the_per_source_accounting_of_its_target(
    registry: RegistryServer,
) -> None:
    """The KServe initializer's counting wrapper declares the accounting it forwards (a Protocol
    check does not look through ``__getattr__`` on Python 3.12+)."""
    inner = open_readable(
        parse_reference(registry.ref("capabilities/counted", "v1")), TargetOptions(plain_http=True)
    )
    wrapped = CountingTarget(inner)
    assert isinstance(wrapped, SourceAccounting)
    assert wrapped.bytes_by_source() == {}


def _any_parameters(root: Path) -> list[str]:
    found = []
    for folder in SOURCE_ROOTS:
        for path in sorted((root / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                a = node.args
                for arg in (*a.posonlyargs, *a.args, *a.kwonlyargs):
                    if arg.annotation is not None and ast.unparse(arg.annotation) in ("Any", "typing.Any"):
                        found.append(f"{path.relative_to(root)}:{arg.lineno} {node.name}({arg.arg})")
    return found


def test_parameters_typed_any_do_not_grow() -> None:
    """Parameters typed ``Any`` stay at or below the recorded ceiling: a new one gets its real
    type (a target, a descriptor, a policy, an event log), which mypy then checks."""
    found = _any_parameters(REPO_ROOT)
    if len(found) > MAX_ANY_PARAMETERS:
        pytest.fail(
            f"{len(found)} parameters typed Any (ceiling {MAX_ANY_PARAMETERS}); give the new ones a real type:\n"
            + "\n".join(found)
        )
    assert found, "the count found no parameter at all: the source folders moved"
