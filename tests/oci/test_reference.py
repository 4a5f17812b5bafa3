from __future__ import annotations

import pytest

from modelpack.errors import InvalidReferenceError
from modelpack.oci.reference import parse_reference

D = "sha256:" + "0123456789abcdef" * 4


@pytest.mark.parametrize(
    "text, scheme, location, repo, tag, digest",
    [
        ("127.0.0.1:5000/models/llama:v1", "registry", "127.0.0.1:5000", "models/llama", "v1", None),
        (f"localhost/m@{D}", "registry", "localhost", "m", None, D),
        (f"ghcr.io/org/m:v2@{D}", "registry", "ghcr.io", "org/m", "v2", D),
        ("llama", "registry", "docker.io", "library/llama", None, None),
        ("org/llama:1", "registry", "docker.io", "org/llama", "1", None),
        ("oci:/tmp/lay:v1", "oci", "/tmp/lay", "", "v1", None),
        ("oci:./rel/dir", "oci", "./rel/dir", "", None, None),
        (f"oci:/tmp/lay@{D}", "oci", "/tmp/lay", "", None, D),
        ("s3://bucket/some/prefix:v3", "s3", "bucket/some/prefix", "", "v3", None),
        ("s3://bucket", "s3", "bucket", "", None, None),
    ],
)
def test_parse(text, scheme, location, repo, tag, digest) -> None:  # type: ignore[no-untyped-def]
    ref = parse_reference(text)
    assert (ref.scheme, ref.location, ref.repository, ref.tag, ref.digest) == (
        scheme,
        location,
        repo,
        tag,
        digest,
    )


def test_identifier_prefers_digest_and_defaults_to_latest() -> None:
    assert parse_reference(f"r.io/m:v1@{D}").identifier == D
    assert parse_reference("r.io/m").identifier == "latest"
    assert str(parse_reference("127.0.0.1:5000/a/b:t")) == "127.0.0.1:5000/a/b:t"


@pytest.mark.parametrize(
    "text",
    [
        "",
        "r.io/UPPER:v1",
        "r.io/m:bad tag",
        "r.io/m@sha256:short",
        "http://r.io/m",
        "s3://B_ad/x",
        "s3://bucket/../x",
        "r.io/m:-dash",
        "oci::v1",
    ],
)
def test_invalid_references_are_refused(text: str) -> None:
    with pytest.raises(InvalidReferenceError):
        parse_reference(text)


@pytest.mark.parametrize(
    "text, location, repo, tag",
    [
        ("oci://127.0.0.1:5000/models/llama:v1", "127.0.0.1:5000", "models/llama", "v1"),
        ("oci://ghcr.io/org/m", "ghcr.io", "org/m", None),
        ("oci://localhost/m:2", "localhost", "m", "2"),
    ],
)
def test_oci_double_slash_names_a_registry_as_kserve_does(
    text: str, location: str, repo: str, tag: str
) -> None:
    """``oci://HOST/REPO`` is a registry repository, as KServe's storage URIs spell one; a layout
    directory is ``oci:DIR`` (no ``//``)."""
    ref = parse_reference(text)
    assert (ref.scheme, ref.location, ref.repository, ref.tag) == ("registry", location, repo, tag)


@pytest.mark.parametrize("text", ["oci://./layout", "oci://models/llama", "oci://", "oci://127.0.0.1:5000"])
def test_oci_double_slash_without_a_registry_host_is_refused(text: str) -> None:
    """``oci://`` followed by anything but ``HOST/REPO`` is refused with the layout spelling, never
    read as a directory called ``//…``."""
    with pytest.raises(InvalidReferenceError, match="oci:DIR"):
        parse_reference(text)


@pytest.mark.parametrize("text", ["127.0.0.1:5000", "localhost:5000", "registry.example:443"])
def test_a_registry_host_and_port_where_a_repository_belongs_is_refused(text: str) -> None:
    """Docker's grammar reads ``HOST:PORT`` as Docker Hub's ``library/HOST`` at tag ``PORT``: a
    registry typed without its repository, refused with the spelling to use instead."""
    with pytest.raises(InvalidReferenceError, match="HOST:PORT/REPOSITORY"):
        parse_reference(text)


def test_a_docker_hub_name_with_a_numeric_tag_still_parses() -> None:
    """Only a host-shaped name (a dot, or localhost) is taken for a registry: ``ubuntu:22`` is
    Docker Hub's, and the long spelling of a dotted one is accepted."""
    ref = parse_reference("ubuntu:22")
    assert (ref.location, ref.repository, ref.tag) == ("docker.io", "library/ubuntu", "22")
    dotted = parse_reference("docker.io/library/my.model:5000")
    assert (dotted.repository, dotted.tag) == ("library/my.model", "5000")
