"""Bounded parsing of everything read from outside.

Each case is a crafted document or file: a shape no file can hold, a 100k-deep document where a
manifest, config, header or audit file should be, a file that only has a ``.safetensors`` name.
Every one must be a typed refusal naming the culprit, never ``RecursionError``, ``TypeError`` or
an accepted artifact that crashes the loader later.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from modelpack.mediatypes import ModelSpecConfig
from modelpack.mediatypes.annotations import layer_file_metadata

from modelpack.boundedjson import loads, loads_object
from modelpack.errors import (
    ConfigError,
    DocumentError,
    ManifestError,
    ModelpackError,
    PackError,
    SafetensorsError,
)
from modelpack.oci.descriptor import Descriptor, Index, Manifest, parse_manifest_or_index
from modelpack.oci.image_config import image_diff_ids
from modelpack.packing.packer import PackOptions, build_artifact
from modelpack.packing.safetensors_format import parse_header_bytes, read_header

DEEP = 100_000


def deep_array(n: int = DEEP) -> bytes:
    return b"[" * n + b"]" * n


def st_file(path: Path, header: dict[str, object] | bytes, data: bytes = b"") -> Path:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def run_cli(*argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "modelpack.cli", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
    )


# --- boundedjson itself --------------------------------------------------------------------------


def test_boundedjson_parses_within_bounds() -> None:
    assert loads(b'{"a": [1, {"b": "x"}]}', what="doc") == {"a": [1, {"b": "x"}]}
    assert loads(deep_array(64), what="doc", max_depth=64) is not None
    # brackets inside strings (escaped quotes included) are not nesting
    text = json.dumps({"s": "[[[[[[" * 100 + '\\"]]' + "{" * 50})
    assert loads(text, what="doc", max_depth=2)["s"].startswith("[[[[")


@pytest.mark.parametrize(
    ("data", "kwargs", "reason"),
    [
        (deep_array(65), {"max_depth": 64}, "nested deeper than 64 levels"),
        (deep_array(DEEP), {}, "nested deeper than"),
        (b'{"a":' * DEEP + b"1" + b"}" * DEEP, {}, "nested deeper than"),
        (b"x" * 101, {"max_bytes": 100}, "exceeds the 100-byte limit"),
        (b'{"a": 1, "a": 2}', {}, "duplicate key 'a'"),
        (b'{"a": "\xff"}', {}, "not UTF-8"),
        (b'{"a": ', {}, "not JSON"),
        (b"[[[]", {}, "not JSON"),
        (b"1" * 5000, {}, "not JSON"),  # longer than Python's int-string limit
        (b"", {}, "not JSON"),
    ],
)
def test_boundedjson_refuses(data: bytes, kwargs: dict[str, int], reason: str) -> None:
    with pytest.raises(DocumentError, match="my doc") as info:
        loads(data, what="my doc", **kwargs)
    assert reason in str(info.value)


def test_boundedjson_object_only() -> None:
    with pytest.raises(DocumentError, match="top level is list"):
        loads_object(b"[1]", what="doc")


# --- safetensors shapes (12.2) ----------------------------------------------------------------


HUGE_SHAPES = [
    [0, 2**63],
    [0, 2**64 + 5],
    [2**63, 0],
    [0, 2**40, 2**40],  # product of the non-zero dims overflows int64 strides
    [0, 2**62, 2],
]


@pytest.mark.parametrize("shape", HUGE_SHAPES)
def test_huge_shape_refused_by_the_parser(tmp_path: Path, shape: list[int]) -> None:
    f = st_file(tmp_path / "m.safetensors", {"big": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}})
    with pytest.raises(SafetensorsError) as info:
        read_header(f)
    assert "'big'" in str(info.value) and str(f) in str(info.value)
    assert "elements" in str(info.value) or "dimension" in str(info.value)


def test_huge_shape_refused_at_pack(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    st_file(ckpt / "model.safetensors", {"w": {"dtype": "F32", "shape": [0, 2**63], "data_offsets": [0, 0]}})
    with pytest.raises(SafetensorsError, match="'w'"):
        build_artifact(str(ckpt), PackOptions(progress="off"))


def test_huge_shape_refused_at_load_never_a_traceback(tmp_path: Path) -> None:
    """The loader reads headers with the same parser: a plain directory holding the crafted file
    is refused with one line naming the file and the tensor (today: torch TypeError)."""
    ckpt = tmp_path / "ckpt"
    st_file(
        ckpt / "model.safetensors",
        {"w": {"dtype": "F32", "shape": [0, 2**40, 2**40], "data_offsets": [0, 0]}},
    )
    proc = run_cli("load", str(ckpt), "--allow-unverified", "--progress", "off")
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "model.safetensors" in proc.stderr and "'w'" in proc.stderr, proc.stderr


def test_too_many_dimensions_refused(tmp_path: Path) -> None:
    f = st_file(
        tmp_path / "m.safetensors", {"w": {"dtype": "F32", "shape": [1] * 1000, "data_offsets": [0, 4]}}
    )
    f.write_bytes(f.read_bytes() + b"\0" * 4)
    with pytest.raises(SafetensorsError, match="dimensions"):
        read_header(f)


def test_zero_sized_and_ordinary_shapes_still_parse(tmp_path: Path) -> None:
    f = st_file(
        tmp_path / "m.safetensors",
        {
            "empty": {"dtype": "BF16", "shape": [0, 4096], "data_offsets": [0, 0]},
            "w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
        },
        b"\0" * 24,
    )
    h = read_header(f)
    assert [t.shape for t in h.tensors] == [(0, 4096), (2, 3)]


# --- safetensors headers: depth and "not a safetensors file" (12.3, 12.10) ---------------------


def test_deep_metadata_is_a_typed_refusal(tmp_path: Path) -> None:
    f = st_file(tmp_path / "m.safetensors", b'{"__metadata__":' + deep_array() + b"}")
    with pytest.raises(SafetensorsError, match="nested deeper"):
        read_header(f)


def test_deep_tensor_entry_is_a_typed_refusal() -> None:
    header = b'{"w":' + deep_array() + b"}"
    with pytest.raises(SafetensorsError, match="nested deeper"):
        parse_header_bytes("x.safetensors", struct.pack("<Q", len(header)), header, 8 + len(header))


def test_duplicate_tensor_names_refused() -> None:
    entry = '{"dtype":"U8","shape":[0],"data_offsets":[0,0]}'
    header = f'{{"a":{entry},"a":{entry}}}'.encode()
    with pytest.raises(SafetensorsError, match="duplicate key 'a'"):
        parse_header_bytes("x.safetensors", struct.pack("<Q", len(header)), header, 8 + len(header))


@pytest.mark.parametrize(
    "content",
    [
        b"hello world, this is a text file and not a checkpoint\n",
        b"PK\x03\x04" + b"\0" * 200,  # a zip (torch .bin) renamed
        b"\x10\0\0\0\0\0\0\0" + b"0123456789abcdef",  # a plausible length, but no JSON object follows
        b"\x02\0\0\0\0\0\0\0[]",
    ],
)
def test_non_safetensors_file_says_so(tmp_path: Path, content: bytes) -> None:
    f = tmp_path / "model.safetensors"
    f.write_bytes(content)
    with pytest.raises(SafetensorsError) as info:
        read_header(f)
    assert "not a safetensors file" in str(info.value), str(info.value)
    assert str(f) in str(info.value)


def test_pack_of_a_renamed_text_file_says_not_a_safetensors_file(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "model.safetensors").write_text("this is not a checkpoint at all\n")
    proc = run_cli("pack", str(ckpt), f"oci:{tmp_path / 'layout'}:v1")
    assert proc.returncode == 1
    assert "not a safetensors file" in proc.stderr and "model.safetensors" in proc.stderr, proc.stderr
    assert "8031924123371070824" not in proc.stderr
    assert "Traceback" not in proc.stderr


# --- manifests, indexes, descriptors (12.3) ------------------------------------------------------


@pytest.mark.parametrize("parse", [Manifest.parse, Index.parse, parse_manifest_or_index])
def test_deep_manifest_is_a_manifest_error(parse: object) -> None:
    raw = b'{"schemaVersion":2,"annotations":' + deep_array() + b"}"
    with pytest.raises(ManifestError, match="nested deeper") as info:
        parse(raw)  # type: ignore[operator]
    assert "sha256:" in str(info.value)  # names the document by its digest


def test_oversized_manifest_is_refused() -> None:
    raw = b'{"schemaVersion":2,"x":"' + b"a" * (4 * 1024 * 1024) + b'"}'
    with pytest.raises(ManifestError, match="limit"):
        Manifest.parse(raw)


def test_duplicate_keys_in_a_manifest_are_refused() -> None:
    """Two parsers that keep different duplicates would see different layers under one digest."""
    d = "sha256:" + "0" * 64
    cfg = f'{{"mediaType":"a/b","digest":"{d}","size":1}}'
    raw = f'{{"schemaVersion":2,"config":{cfg},"layers":[],"layers":[{cfg}]}}'.encode()
    with pytest.raises(ManifestError, match="duplicate key 'layers'"):
        Manifest.parse(raw)


_CFG = {"mediaType": "a/b", "digest": "sha256:" + "0" * 64, "size": 1}


@pytest.mark.parametrize(
    ("extra", "culprit"),
    [
        ({"annotations": ["not", "a", "map"]}, "annotations"),
        ({"annotations": {"k": 1}}, "annotations"),
        ({"artifactType": 7}, "artifactType"),
        ({"subject": "sha256:abc"}, "subject"),
        ({"layers": [dict(_CFG, urls="http://x")]}, "urls"),
        ({"layers": [dict(_CFG, platform=[1])]}, "platform"),
        ({"layers": [dict(_CFG, data=5)]}, "data"),
        ({"layers": [dict(_CFG, size=2**64)]}, "size"),
        ({"mediaType": ["x"]}, "mediaType"),
    ],
)
def test_manifest_fields_of_the_wrong_type_are_refused(extra: dict[str, object], culprit: str) -> None:
    doc = {"schemaVersion": 2, "config": _CFG, "layers": [], **extra}
    with pytest.raises(ManifestError, match=culprit):
        Manifest.parse(json.dumps(doc).encode())


def test_descriptor_from_dict_names_where() -> None:
    with pytest.raises(ManifestError, match="layer 3: missing 'digest'"):
        Descriptor.from_dict({"mediaType": "a/b", "size": 1}, where="layer 3")


# --- configs (mediatypes, image config, packing config.json) -------------------------------------


def test_deep_model_config_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="nested deeper"):
        ModelSpecConfig.from_bytes(b'{"descriptor":' + deep_array() + b"}")


def test_model_config_with_duplicate_keys_is_refused() -> None:
    with pytest.raises(ConfigError, match="duplicate key"):
        ModelSpecConfig.from_bytes(b'{"descriptor":{},"descriptor":{}}')


def test_deep_image_config_is_a_manifest_error() -> None:
    with pytest.raises(ManifestError, match="nested deeper"):
        image_diff_ids(b'{"rootfs":' + deep_array() + b"}", 1)


def test_file_metadata_annotation_is_bounded_and_typed() -> None:
    key = "org.cncf.model.file.metadata+json"
    with pytest.raises(ModelpackError, match="nested deeper"):
        layer_file_metadata({key: "[" * 1000 + "]" * 1000})
    with pytest.raises(ModelpackError, match="not JSON"):
        layer_file_metadata({key: "{not json"})
    with pytest.raises(ModelpackError, match="64 KiB"):
        layer_file_metadata({key: '"' + "a" * 70_000 + '"'})


def test_deep_config_json_in_a_checkpoint_is_a_pack_error(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    st_file(ckpt / "model.safetensors", {"w": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}})
    (ckpt / "config.json").write_bytes(deep_array())
    with pytest.raises(PackError, match=r"config\.json") as info:
        build_artifact(str(ckpt), PackOptions(progress="off"))
    assert "nested deeper" in str(info.value)


def test_created_flag_is_checked_and_named(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    st_file(ckpt / "model.safetensors", {"w": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}})
    proc = run_cli("pack", str(ckpt), f"oci:{tmp_path / 'l'}:v1", "--created", "2025-01-02")
    assert proc.returncode != 0
    assert "--created" in proc.stderr and "2025-01-02" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


# --- audit/diff inputs (inspection) --------------------------------------------------------------


def test_deep_audit_since_file_is_a_typed_refusal(tmp_path: Path) -> None:
    from modelpack.inspection.audit import load_since

    f = tmp_path / "since.json"
    f.write_bytes(deep_array())
    with pytest.raises(ModelpackError, match="nested deeper") as info:
        load_since(str(f))
    assert str(f) in str(info.value)


def test_header_length_over_the_limit_in_a_large_file(tmp_path: Path) -> None:
    """A length that fits the file but exceeds 100 MB is the limit's refusal, not "not safetensors"."""
    f = tmp_path / "big.safetensors"
    with open(f, "wb") as out:
        out.write(struct.pack("<Q", 100_000_001) + b"{")
        out.truncate(8 + 100_000_001 + 16)  # sparse: no 100 MB written
    with pytest.raises(SafetensorsError, match="exceeds the 100 MB limit"):
        read_header(f)


def test_file_paths_longer_than_a_file_system_allows_are_refused() -> None:
    from modelpack.mediatypes.annotations import safe_relative_path

    from modelpack.errors import UnsafePathError

    assert safe_relative_path("a/" + "b" * 255) == "a/" + "b" * 255
    with pytest.raises(UnsafePathError, match="longer than") as info:
        safe_relative_path("a/" + "b" * 256)
    assert len(str(info.value)) < 400  # the message stays one readable line
    with pytest.raises(UnsafePathError, match="longer than"):
        safe_relative_path("/".join(["d" * 200] * 30))
