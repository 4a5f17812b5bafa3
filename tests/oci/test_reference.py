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
