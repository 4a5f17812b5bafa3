"""Property-based tests of the parsers that read untrusted bytes.

For any input, the safetensors header parser, the manifest/index/descriptor parser, the model
config parser, boundedjson and the reference parser either return a value or raise the project's
own error for that input. Anything else (``TypeError``, ``KeyError``, ``RecursionError``,
``OverflowError``…) is a crash a hostile file or registry could trigger, and fails the test.

Inputs come in two kinds: raw bytes (anything at all) and structured JSON built from each
format's own vocabulary, so the search reaches the checks behind the JSON parser too.
"""

from __future__ import annotations

import io
import json
import struct
from typing import Any

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from modelpack.mediatypes import ModelSpecConfig

from modelpack.boundedjson import loads
from modelpack.errors import (
    ConfigError,
    DocumentError,
    InvalidReferenceError,
    ManifestError,
    SafetensorsError,
)
from modelpack.oci.descriptor import Descriptor, Index, Manifest, parse_manifest_or_index
from modelpack.oci.reference import parse_reference
from modelpack.packing.safetensors_format import DTYPE_BITS, parse_header_bytes, read_header_from

# no example database in the work tree; enough examples to matter, few enough for 2 cores
PROPS = settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
#: structured JSON costs more to generate than bytes: fewer examples, same reach per second
STRUCTURED = settings(PROPS, max_examples=120)

# --- JSON values built from a format's vocabulary --------------------------------------------------

INTS = st.one_of(
    st.integers(min_value=-3, max_value=70),
    st.sampled_from([0, 1, 2**31, 2**32, 2**48, 2**48 + 1, 2**53, 2**62, 2**63 - 1, 2**63, 2**64, -(2**63)]),
)
SCALARS = st.one_of(
    st.none(), st.booleans(), INTS, st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12)
)


def json_values(keys: st.SearchStrategy[str]) -> st.SearchStrategy[Any]:
    return st.recursive(
        SCALARS,
        lambda children: st.one_of(
            st.lists(children, max_size=5), st.dictionaries(keys, children, max_size=5)
        ),
        max_leaves=30,
    )


def _encode(doc: Any) -> bytes:
    return json.dumps(doc, allow_nan=False).encode()


# --- safetensors headers -------------------------------------------------------------------------

ST_KEYS = st.sampled_from(["dtype", "shape", "data_offsets", "__metadata__", "w", "b", "x"])
TENSOR_ENTRY = st.fixed_dictionaries(
    {},
    optional={
        "dtype": st.one_of(st.sampled_from(sorted(DTYPE_BITS)), json_values(ST_KEYS)),
        "shape": st.one_of(st.lists(INTS, max_size=5), json_values(ST_KEYS)),
        "data_offsets": st.one_of(st.lists(INTS, min_size=2, max_size=2), json_values(ST_KEYS)),
    },
)
HEADER_DOC = st.dictionaries(
    st.sampled_from(["w", "b", "x", "__metadata__"]),
    st.one_of(TENSOR_ENTRY, json_values(ST_KEYS)),
    max_size=4,
)


def _parse_file(data: bytes) -> None:
    try:
        read_header_from(io.BytesIO(data), "prop.safetensors", len(data))
    except SafetensorsError:
        pass


@PROPS
@given(st.binary(max_size=512))
@example(b"hello world, not a checkpoint")
@example(struct.pack("<Q", 2) + b"[]")
@example(struct.pack("<Q", 2**64 - 1))
def test_safetensors_any_bytes(data: bytes) -> None:
    _parse_file(data)


@STRUCTURED
@given(HEADER_DOC, st.integers(min_value=0, max_value=64))
@example({"w": {"dtype": "F32", "shape": [0, 2**63], "data_offsets": [0, 0]}}, 0)
@example({"w": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}}, 4)
@example({"__metadata__": {"a": [1]}}, 0)
def test_safetensors_structured_headers(doc: dict[str, Any], data_len: int) -> None:
    header = _encode(doc)
    _parse_file(struct.pack("<Q", len(header)) + header + bytes(data_len))


@PROPS
@given(st.binary(max_size=300), st.integers(min_value=0, max_value=2**64))
def test_safetensors_prefix_and_size_disagree(header: bytes, file_size: int) -> None:
    """Range readers (registry, S3, loader) pass a declared size that may not match the bytes."""
    try:
        parse_header_bytes("prop.safetensors", struct.pack("<Q", len(header)), header, file_size)
    except SafetensorsError:
        pass


# --- manifests, indexes, descriptors -------------------------------------------------------------

OCI_KEYS = st.sampled_from(
    [
        "schemaVersion",
        "mediaType",
        "config",
        "layers",
        "manifests",
        "digest",
        "size",
        "annotations",
        "artifactType",
        "subject",
        "platform",
        "urls",
        "data",
    ]
)
DIGESTS = st.one_of(st.just("sha256:" + "0" * 64), st.text(max_size=20))
DESCRIPTOR = st.fixed_dictionaries(
    {},
    optional={
        "mediaType": st.one_of(st.just("application/octet-stream"), json_values(OCI_KEYS)),
        "digest": st.one_of(DIGESTS, json_values(OCI_KEYS)),
        "size": st.one_of(INTS, json_values(OCI_KEYS)),
        "annotations": json_values(OCI_KEYS),
        "artifactType": json_values(OCI_KEYS),
        "platform": json_values(OCI_KEYS),
        "urls": json_values(OCI_KEYS),
        "data": json_values(OCI_KEYS),
    },
)
MANIFEST_DOC = st.fixed_dictionaries(
    {},
    optional={
        "schemaVersion": st.one_of(st.just(2), json_values(OCI_KEYS)),
        "mediaType": st.one_of(
            st.sampled_from(
                [
                    "application/vnd.oci.image.manifest.v1+json",
                    "application/vnd.oci.image.index.v1+json",
                    "application/vnd.docker.distribution.manifest.v2+json",
                ]
            ),
            json_values(OCI_KEYS),
        ),
        "config": st.one_of(DESCRIPTOR, json_values(OCI_KEYS)),
        "layers": st.one_of(st.lists(DESCRIPTOR, max_size=3), json_values(OCI_KEYS)),
        "manifests": st.one_of(st.lists(DESCRIPTOR, max_size=3), json_values(OCI_KEYS)),
        "subject": st.one_of(DESCRIPTOR, json_values(OCI_KEYS)),
        "annotations": json_values(OCI_KEYS),
        "artifactType": json_values(OCI_KEYS),
    },
)
MEDIA_TYPE_HINTS = st.one_of(st.none(), st.sampled_from(["application/vnd.oci.image.index.v1+json", "x/y"]))


def _well_typed(d: Descriptor) -> None:
    """What a parser accepted has the types its callers rely on (else they crash later)."""
    assert isinstance(d.media_type, str) and isinstance(d.size, int) and 0 <= d.size < 2**63
    assert d.annotations is None or all(isinstance(v, str) for v in d.annotations.values())
    assert d.artifact_type is None or isinstance(d.artifact_type, str)
    assert d.platform is None or isinstance(d.platform, dict)
    assert d.data is None or isinstance(d.data, str)
    assert d.urls is None or all(isinstance(u, str) for u in d.urls)


def _parse_manifest(raw: bytes, media_type: str | None) -> None:
    for parse in (Manifest.parse, Index.parse, parse_manifest_or_index):
        try:
            parsed = parse(raw, media_type=media_type)
        except ManifestError:
            continue
        descriptors = [parsed.config, *parsed.layers] if isinstance(parsed, Manifest) else [*parsed.manifests]
        for d in [*descriptors, *([parsed.subject] if parsed.subject else [])]:
            _well_typed(d)
        assert parsed.annotations is None or all(isinstance(v, str) for v in parsed.annotations.values())
        assert parsed.artifact_type is None or isinstance(parsed.artifact_type, str)


@PROPS
@given(st.binary(max_size=400), MEDIA_TYPE_HINTS)
@example(b"[" * 10_000 + b"]" * 10_000, None)
def test_manifest_any_bytes(raw: bytes, media_type: str | None) -> None:
    _parse_manifest(raw, media_type)


@STRUCTURED
@given(MANIFEST_DOC, MEDIA_TYPE_HINTS)
def test_manifest_structured(doc: dict[str, Any], media_type: str | None) -> None:
    _parse_manifest(_encode(doc), media_type)


@STRUCTURED
@given(st.one_of(DESCRIPTOR, json_values(OCI_KEYS)))
def test_descriptor_from_any_json_value(value: Any) -> None:
    try:
        d = Descriptor.from_dict(value, where="prop")
    except ManifestError:
        return
    _well_typed(d)
    Descriptor.from_dict(d.to_dict())  # what we parsed, we can write back and read again


# --- model config, boundedjson -------------------------------------------------------------------

CONFIG_KEYS = st.sampled_from(
    ["descriptor", "config", "modelfs", "name", "createdAt", "type", "diffIds", "capabilities", "inputTypes"]
)


@STRUCTURED
@given(st.one_of(st.binary(max_size=300), json_values(CONFIG_KEYS).map(_encode)))
def test_model_config_any_input(raw: bytes) -> None:
    try:
        ModelSpecConfig.from_bytes(raw)
    except ConfigError:
        pass


@PROPS
@given(st.binary(max_size=300), st.integers(min_value=1, max_value=8))
def test_boundedjson_any_bytes(raw: bytes, depth: int) -> None:
    try:
        loads(raw, what="prop", max_depth=depth)
    except DocumentError:
        pass


# --- references ----------------------------------------------------------------------------------

REF_TEXT = st.one_of(
    st.text(max_size=80),
    st.binary(max_size=80).map(lambda b: b.decode("latin-1")),
    st.lists(
        st.sampled_from(
            [
                "oci:",
                "s3://",
                "localhost",
                ":5000",
                "/",
                "@",
                "sha256:",
                "0" * 64,
                ":",
                "a",
                "A",
                ".",
                "..",
                "[::1]",
            ]
        ),
        max_size=10,
    ).map("".join),
)


@PROPS
@given(REF_TEXT)
@example("oci:")
@example("localhost:5000/m@sha256:xyz")
def test_reference_any_text(text: str) -> None:
    try:
        ref = parse_reference(text)
    except InvalidReferenceError:
        return
    str(ref)  # a parsed reference always prints
