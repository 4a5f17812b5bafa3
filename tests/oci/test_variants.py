"""Variants: an OCI image index of ModelPack manifests, one entry per node.

Two variants of one small generated model (bf16 and f32) are packed and pushed to a real registry
(distribution 2.8); each test writes its own index with ``modelpack index create`` / ``push
--variant`` and checks what a node does with it: the bytes against the OCI index schema and
``skopeo inspect --raw``, selection by ``--variant`` and by the node's device arch, the refusals
(nothing fits, a tie, a hostile index), signatures of the index and of each entry, the node cache's
records and an offline pinned pull, ``load`` and ``inspect``/``audit``. The selection rules
themselves are checked on indexes built in memory.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import platform
import subprocess
from pathlib import Path
from typing import Any

import pytest
import requests
from modelpack.mediatypes import MEDIA_TYPE_OCI_INDEX, MEDIA_TYPE_OCI_MANIFEST
from modelpack.mediatypes.variants import (
    ANNOTATION_VARIANT_ACCELERATOR,
    ANNOTATION_VARIANT_PRECISION,
    accelerator_fits,
)

from modelpack import api
from modelpack.api.variants import create_index, push_variant
from modelpack.errors import SignatureRefused, VariantIndexError, VariantSelectionError
from modelpack.oci.descriptor import Descriptor, Index, Manifest
from modelpack.oci.digest import Digest
from modelpack.oci.variant_index import MAX_VARIANT_ENTRIES, VariantIndex, variant_index
from modelpack.oci.variant_selection import VariantSelector
from modelpack.targets.opener import TargetOptions, open_readable
from modelpack.testdata.synthetic import SyntheticSpec, write_checkpoint
from tests.paths import FIXTURES

PLAIN = TargetOptions(plain_http=True)
SCHEMA_DIR = FIXTURES / "oci-image-spec-schema"
NODE_ARCH = f"cpu-{platform.machine()}"
pytestmark = pytest.mark.timeout(180)


def _cli(*args: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
    """The CLI in this process (click's runner: no interpreter start per call); stdout/stderr apart."""
    from click.testing import CliRunner

    from modelpack.cli import main

    res = CliRunner().invoke(main, list(args))
    proc = subprocess.CompletedProcess(list(args), res.exit_code, res.stdout, res.stderr)
    if ok:
        assert proc.returncode == 0, proc.stderr
    return proc


@dataclasses.dataclass
class Variants:
    host: str
    bf16: str  # manifest digests in variants/src
    f32: str
    ckpt: dict[str, Path]
    key: Path
    pub: Path
    other_pub: Path


@pytest.fixture(scope="module")
def variants(registry, tmp_path_factory: pytest.TempPathFactory) -> Variants:  # type: ignore[no-untyped-def]
    from modelpack.signing import generate_key
    from modelpack.signing.keys import write_keypair

    base = tmp_path_factory.mktemp("variants")
    digests, ckpts = {}, {}
    for dtype in ("BF16", "F32"):
        d = base / dtype.lower()
        write_checkpoint(str(d), SyntheticSpec(hidden=64, intermediate=128, vocab=128, layers=1, dtype=dtype))
        ckpts[dtype.lower()] = d
        digests[dtype.lower()] = api.push(
            str(d), registry.ref("variants/src", dtype.lower()), target_options=PLAIN
        ).digest
    key, _ = write_keypair(str(base / "ci"), generate_key())
    _, other = write_keypair(str(base / "other"), generate_key())
    return Variants(
        registry.host, digests["bf16"], digests["f32"], ckpts, Path(key), Path(key[:-4] + ".pub"), Path(other)
    )


def _index(v: Variants, repo: str, *extra: str) -> str:
    """``index create HOST/repo:v1`` of the bf16 and f32 variants (f32 for accelerator=cpu)."""
    out = _cli(
        "index",
        "create",
        f"{v.host}/{repo}:v1",
        f"{v.host}/variants/src:bf16",
        f"{v.host}/variants/src:f32",
        "--variant",
        "2:accelerator=cpu",
        *extra,
    )
    return out.stdout.strip()


def _get_raw(host: str, repo: str, ref: str) -> requests.Response:
    r = requests.get(
        f"http://{host}/v2/{repo}/manifests/{ref}",
        headers={"Accept": f"{MEDIA_TYPE_OCI_INDEX}, {MEDIA_TYPE_OCI_MANIFEST}"},
        timeout=10,
    )
    r.raise_for_status()
    return r


def _validate_oci_index(raw: bytes) -> None:
    import jsonschema
    from referencing import Registry, Resource
    from referencing.jsonschema import DRAFT4

    schemas = {p.name: json.loads(p.read_text()) for p in SCHEMA_DIR.glob("*.json")}
    # the schemas' $refs are file names relative to their ids: serve the vendored copies there
    resources = [
        (f"https://opencontainers.org/schema/{prefix}{name}", Resource.from_contents(doc, DRAFT4))
        for name, doc in schemas.items()
        for prefix in ("", "image/")
    ]
    reg = Registry().with_resources(resources)
    jsonschema.Draft4Validator(schemas["image-index-schema.json"], registry=reg).validate(json.loads(raw))


# --------------------------------------------------------------------------- the index itself
def test_index_create_keeps_each_variant_exactly_and_the_registry_and_skopeo_read_it_back(
    variants: Variants,
) -> None:
    v = variants
    digest = _index(v, "variants/idx-create")
    r = _get_raw(v.host, "variants/idx-create", "v1")
    assert r.headers["Content-Type"] == MEDIA_TYPE_OCI_INDEX  # distribution 2.8 serves it as one
    raw = r.content
    assert "sha256:" + hashlib.sha256(raw).hexdigest() == digest
    _validate_oci_index(raw)
    doc = json.loads(raw)
    assert [m["digest"] for m in doc["manifests"]] == [v.bf16, v.f32]
    assert [m["annotations"][ANNOTATION_VARIANT_PRECISION] for m in doc["manifests"]] == ["bf16", "f32"]
    assert doc["manifests"][1]["annotations"][ANNOTATION_VARIANT_ACCELERATOR] == "cpu"
    assert ANNOTATION_VARIANT_ACCELERATOR not in doc["manifests"][0]["annotations"]
    # the variants were copied into the index's repository byte for byte (same digests)
    for entry in doc["manifests"]:
        got = _get_raw(v.host, "variants/idx-create", entry["digest"]).content
        assert "sha256:" + hashlib.sha256(got).hexdigest() == entry["digest"]
        assert len(got) == entry["size"]
    skopeo = subprocess.run(
        ["skopeo", "inspect", "--raw", "--tls-verify=false", f"docker://{v.host}/variants/idx-create:v1"],
        capture_output=True,
        timeout=60,
        check=True,
    )
    assert skopeo.stdout == raw
    shown = json.loads(_cli("inspect", f"{v.host}/variants/idx-create:v1", "--json").stdout)
    assert shown["digest"] == digest
    assert [e["variant"]["precision"] for e in shown["variants"]] == ["bf16", "f32"]
    audit = json.loads(_cli("audit", f"{v.host}/variants/idx-create", "--json").stdout)
    version = next(x for x in audit["repositories"][0]["versions"] if x["digest"] == digest)
    assert [e["digest"] for e in version["variants"]] == [v.bf16, v.f32]


def test_skopeo_copy_all_keeps_the_index_digest_so_pins_and_signatures_still_match(
    variants: Variants, tmp_path: Path
) -> None:
    """``skopeo copy --all`` re-serialises an index it does not know fields of: the optional
    ``artifactType`` of the index and of its entries was dropped, the digest changed, and pins
    and index signatures no longer matched the copy. The index holds only what the common copy
    tools keep, so the copy is byte for byte the same, in a registry and in a layout, and pulls."""
    v = variants
    digest = _index(v, "variants/idx-skopeo")
    raw = _get_raw(v.host, "variants/idx-skopeo", "v1").content
    assert b"artifactType" not in raw
    for dest in (f"docker://{v.host}/variants/idx-skopeo-copy:v1", f"oci:{tmp_path / 'copy'}:v1"):
        subprocess.run(
            [
                "skopeo",
                "copy",
                "--all",
                "--src-tls-verify=false",
                "--dest-tls-verify=false",
                f"docker://{v.host}/variants/idx-skopeo:v1",
                dest,
            ],
            capture_output=True,
            timeout=120,
            check=True,
        )
    copied = _get_raw(v.host, "variants/idx-skopeo-copy", "v1").content
    assert copied == raw and "sha256:" + hashlib.sha256(copied).hexdigest() == digest
    layout_index = json.loads((tmp_path / "copy" / "index.json").read_text())
    assert [m["digest"] for m in layout_index["manifests"]] == [digest]
    out = tmp_path / "pulled"
    _cli("pull", f"{v.host}/variants/idx-skopeo-copy@{digest}", str(out), "--variant", "precision=f32")
    assert any(out.glob("*.safetensors"))


def test_index_entries_are_numbered_from_one_as_variant_n_counts_them(variants: Variants) -> None:
    """``index create`` and ``index show`` number the first entry #1, the N that ``--variant N:``
    gives it; ``--json`` says the same position."""
    v = variants
    made = _cli(
        "index",
        "create",
        f"{v.host}/variants/idx-numbers:v1",
        f"{v.host}/variants/src:bf16",
        f"{v.host}/variants/src:f32",
        "--variant",
        "2:accelerator=cpu",
    )
    lines = [line.split() for line in made.stderr.splitlines() if line.strip().startswith("#")]
    assert [(n, d) for n, d, *_ in lines] == [("#1", v.bf16), ("#2", v.f32)]
    assert "accelerator=cpu" in " ".join(lines[1])
    shown = json.loads(_cli("index", "show", f"{v.host}/variants/idx-numbers:v1", "--json").stdout)
    assert [(e["position"], e["digest"]) for e in shown["variants"]] == [(1, v.bf16), (2, v.f32)]


def test_an_index_in_an_oci_layout_and_in_s3_reads_the_same(variants: Variants, tmp_path: Path, s3) -> None:  # type: ignore[no-untyped-def]
    v = variants
    layout = tmp_path / "layout"
    src = [f"{v.host}/variants/src@{v.bf16}", f"{v.host}/variants/src@{v.f32}"]
    made = create_index(f"oci:{layout}:v1", src, overrides={1: {"accelerator": "cpu"}}, target_options=PLAIN)
    skopeo = subprocess.run(
        ["skopeo", "inspect", "--raw", f"oci:{layout}:v1"], capture_output=True, timeout=60, check=True
    )
    assert skopeo.stdout == made.index.index.raw
    _validate_oci_index(skopeo.stdout)
    bucket = s3.make_bucket()
    s3_opts = TargetOptions(plain_http=True, s3_endpoint=s3.endpoint)
    in_s3 = create_index(
        f"s3://{bucket}/m:v1",
        [f"oci:{layout}@{v.bf16}", f"oci:{layout}@{v.f32}"],
        overrides={1: {"accelerator": "cpu"}},
        target_options=s3_opts,
    )
    assert in_s3.digest == made.digest  # same variants, same fields: the same index bytes
    assert api.inspect(f"s3://{bucket}/m@{v.bf16}", s3_opts).digest == v.bf16


def test_push_variant_adds_and_replaces_entries_and_refuses_a_plain_manifest(
    variants: Variants, tmp_path: Path
) -> None:
    v = variants
    layout = f"oci:{tmp_path / 'layout'}"
    first = push_variant(str(v.ckpt["bf16"]), f"{layout}:v1", ["engine=vllm"])
    assert [e.fields for e in first.index.entries] == [
        {"precision": "bf16", "quantization": "none", "engine": "vllm"}
    ]
    second = push_variant(
        f"{v.host}/variants/src@{v.f32}", f"{layout}:v1", {"engine": "vllm"}, target_options=PLAIN
    )
    assert [str(e.descriptor.digest) for e in second.index.entries] == [v.bf16, v.f32]
    again = push_variant(str(v.ckpt["bf16"]), f"{layout}:v1", ["engine=vllm", "tp-size=2"])
    assert [e.fields.get("tp-size") for e in again.index.entries] == [None, "2"]  # bf16 replaced, last
    assert [str(e.descriptor.digest) for e in again.index.entries] == [v.f32, v.bf16]
    # an index as a variant of an index, and two entries no node could tell apart: refused at create
    with pytest.raises(VariantIndexError, match="is an index; an index entry must be a model manifest"):
        create_index(f"{layout}:nested", [f"{layout}:v1"])
    with pytest.raises(VariantIndexError, match="have the same variant fields"):
        create_index(f"{layout}:dup", [f"{layout}@{v.bf16}", f"{layout}@{v.bf16}"])
    api.cp(f"{layout}@{v.f32}", f"{layout}:plain")
    with pytest.raises(VariantIndexError, match="holds a model manifest, not an index"):
        push_variant(str(v.ckpt["bf16"]), f"{layout}:plain", ["engine=x"])


# --------------------------------------------------------------------------- selection rules
def _entries(*fields: dict[str, str]) -> VariantIndex:
    from modelpack.mediatypes.variants import VARIANT_KEYS

    descs = [
        Descriptor(
            MEDIA_TYPE_OCI_MANIFEST,
            Digest.from_bytes(f"m{i}".encode()),
            10,
            annotations={VARIANT_KEYS[k]: x for k, x in f.items()} or None,
        )
        for i, f in enumerate(fields)
    ]
    return variant_index(Index.build(descs))


def test_selection_by_variant_by_fingerprint_most_specific_and_the_refusals_name_the_fields() -> None:
    vi = _entries(
        {"precision": "bf16", "accelerator": "cuda"},
        {"precision": "bf16", "accelerator": "cuda-sm_90"},
        {"precision": "f32", "accelerator": "cpu"},
        {"precision": "bf16", "layout": "sharded_state", "tp-size": "2", "engine": "vllm"},
    )
    h200 = "cuda-sm_90-NVIDIA H200"
    # the node's device arch: the longer accelerator prefix wins over 'cuda'
    assert VariantSelector.from_options(accelerator=h200).select(vi).chosen.position == 2
    assert VariantSelector.from_options(accelerator="cuda-sm_80-NVIDIA A100").select(vi).chosen.position == 1
    assert VariantSelector.from_options(accelerator=NODE_ARCH).select(vi).chosen.position == 3
    # --variant: exact; the sharded entry needs TP 2 and the engine
    sel = VariantSelector.from_options(["layout=sharded_state"], accelerator=h200, tp_size=2, engine="vllm")
    assert sel.select(vi).chosen.position == 4
    assert (
        VariantSelector.from_options(["precision=bfloat16"], accelerator=h200).select(vi).chosen.position == 2
    )
    with pytest.raises(VariantSelectionError) as nothing:
        VariantSelector.from_options(["layout=sharded_state"], accelerator=h200, tp_size=4).select(vi)
    why = nothing.value.reasons
    assert list(why) == [e.label for e in vi.entries]  # every entry, each with its fields
    assert "layout: wanted sharded_state, entry declares none" in why[vi.entries[0].label]
    assert "tp-size: entry is for 2, this node runs 4" in why[vi.entries[3].label]
    assert "engine: entry is for vllm, the caller names no engine" in why[vi.entries[3].label]
    with pytest.raises(VariantSelectionError, match="accelerator: entry is for cpu, this node is cuda-sm_90"):
        VariantSelector.from_options(["precision=f32"], accelerator=h200).select(vi)
    # equal fits are a tie, never a pick by position
    tie = _entries({"precision": "bf16"}, {"precision": "f32"})
    with pytest.raises(VariantSelectionError, match="2 variants fit equally") as tied:
        VariantSelector.from_options(accelerator=NODE_ARCH).select(tie)
    assert tied.value.candidates == [e.label for e in tie.entries]
    assert VariantSelector.from_options(["precision=f32"]).select(tie).chosen.position == 2
    with pytest.raises(VariantSelectionError, match="layout: sharded_state without a tp-size"):
        VariantSelector.from_options().select(_entries({"layout": "sharded_state"}))
    # the prefix rule is on whole '-' parts
    assert accelerator_fits("cuda-sm_90", h200) and not accelerator_fits("cuda-sm_9", h200)
    with pytest.raises(VariantIndexError, match="unknown field"):
        VariantSelector.from_options(["colour=red"])


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (lambda d: [dataclasses.replace(d[0], media_type=MEDIA_TYPE_OCI_INDEX)], "nesting is refused"),
        (
            lambda d: [
                dataclasses.replace(d[0], media_type="application/vnd.docker.distribution.manifest.v2+json")
            ],
            "not an OCI image manifest",
        ),
        (lambda d: d * (MAX_VARIANT_ENTRIES + 1), "at most 256"),
        (lambda d: [dataclasses.replace(d[0], annotations={"x": "y" * 9000})], "bytes of annotations"),
        (
            lambda d: [dataclasses.replace(d[0], annotations={ANNOTATION_VARIANT_PRECISION: "bf16\x1b[2J"})],
            "characters outside",
        ),
        (
            lambda d: [dataclasses.replace(d[0], annotations={"dev.modelpack.variant.tp-size": "0"})],
            "positive integer",
        ),
    ],
)
def test_a_hostile_index_is_refused_before_anything_compares_or_prints_it(mutate: Any, needle: str) -> None:
    base = [Descriptor(MEDIA_TYPE_OCI_MANIFEST, Digest.from_bytes(b"m"), 10)]
    with pytest.raises(VariantIndexError, match=needle):
        variant_index(Index.build(mutate(base)))


def test_an_entry_that_is_not_a_modelpack_manifest_or_not_its_bytes_is_refused(
    variants: Variants, tmp_path: Path
) -> None:
    from modelpack.oci.descriptor import empty_config_descriptor
    from modelpack.targets.layout import OCILayoutTarget

    v = variants
    layout = tmp_path / "layout"
    made = create_index(f"oci:{layout}:v1", [f"{v.host}/variants/src@{v.bf16}"], target_options=PLAIN)
    target = OCILayoutTarget(str(layout))
    # an image manifest (empty config, no model artifact type) listed as a variant
    foreign = Manifest.build(empty_config_descriptor(), [])
    from modelpack.targets.base import bytes_blob_source

    target.push_blob(bytes_blob_source(empty_config_descriptor(), b"{}"))
    target.push_manifest(foreign.raw, foreign.media_type)
    hostile = Index.build([foreign.descriptor({ANNOTATION_VARIANT_PRECISION: "bf16"})])
    target.push_manifest(hostile.raw, MEDIA_TYPE_OCI_INDEX, "hostile")
    out = _cli("pull", f"oci:{layout}:hostile", str(tmp_path / "out"), ok=False)
    assert out.returncode == 1 and "not a ModelPack manifest" in out.stderr
    # the entry's bytes swapped for another manifest's in storage: refused by digest
    blob = layout / "blobs" / "sha256" / Digest(v.bf16).hex
    blob.chmod(0o644)
    blob.write_bytes(foreign.raw)
    out = _cli("pull", f"oci:{layout}@{made.digest}", "--cache", str(tmp_path / "cache"), ok=False)
    assert out.returncode == 1 and "sha256" in out.stderr and "Traceback" not in out.stderr
    assert not list((tmp_path / "cache" / "snapshots").glob("*/"))


# --------------------------------------------------------------------------- pull, cache, load
def test_pull_selects_by_variant_and_by_device_arch_and_refuses_what_does_not_fit(
    variants: Variants, tmp_path: Path
) -> None:
    v = variants
    _index(v, "variants/idx-pull")
    ref = f"{v.host}/variants/idx-pull:v1"
    bf = json.loads(_cli("pull", ref, str(tmp_path / "bf"), "--variant", "precision=bf16", "--json").stdout)
    assert bf["digest"] == v.bf16 and bf["variant"]["chosen"] == v.bf16
    assert (tmp_path / "bf" / "model.safetensors").read_bytes() == (
        v.ckpt["bf16"] / "model.safetensors"
    ).read_bytes()
    # no --variant: this CPU node's device arch selects the accelerator=cpu entry
    auto = json.loads(_cli("pull", ref, str(tmp_path / "auto"), "--json").stdout)
    assert auto["digest"] == v.f32 and auto["variant"]["node"]["accelerator"] == NODE_ARCH
    shown = json.loads(_cli("index", "show", ref, "--variant", "precision=bf16", "--json").stdout)
    assert shown["selection"]["chosen"] == v.bf16
    assert [e["fits"] for e in shown["selection"]["entries"]] == [True, False]
    none = _cli("pull", ref, str(tmp_path / "none"), "--variant", "precision=f16", ok=False)
    assert none.returncode == 1 and "no variant fits" in none.stderr
    assert (
        "precision: wanted f16, entry has bf16" in none.stderr
        and "precision: wanted f16, entry has f32" in none.stderr
    )
    assert not (tmp_path / "none").exists() or not any((tmp_path / "none").iterdir())
    # an index without accelerators: both fit a node, so a pull without --variant is a tie
    _cli(
        "index",
        "create",
        f"{v.host}/variants/idx-tie:v1",
        f"{v.host}/variants/src:bf16",
        f"{v.host}/variants/src:f32",
    )
    tie = _cli("pull", f"{v.host}/variants/idx-tie:v1", str(tmp_path / "tie"), ok=False)
    assert tie.returncode == 1 and "2 variants fit equally" in tie.stderr and "--variant" in tie.stderr


def test_the_node_cache_keeps_each_variant_once_records_the_index_and_a_pinned_pull_works_offline(
    variants: Variants, tmp_path: Path
) -> None:
    v = variants
    index = _index(v, "variants/idx-cache")
    cache = tmp_path / "cache"
    ref = f"{v.host}/variants/idx-cache:v1"
    for precision, want in (("bf16", v.bf16), ("f32", v.f32)):
        got = json.loads(
            _cli("pull", ref, "--cache", str(cache), "--variant", f"precision={precision}", "--json").stdout
        )
        assert got["digest"] == want and got["variant"]["index"] == index
    ls = json.loads(_cli("cache", "ls", "--cache", str(cache), "--json").stdout)
    by_digest = {s["digest"]: s for s in ls["snapshots"]}
    assert set(by_digest) == {v.bf16, v.f32}  # one snapshot per variant, none for the index
    for d, precision in ((v.bf16, "bf16"), (v.f32, "f32")):
        assert by_digest[d]["indexes"] == [
            {
                "index": index,
                "reference": ref,
                "variant": {
                    **({"accelerator": "cpu"} if precision == "f32" else {}),
                    "precision": precision,
                    "quantization": "none",
                },
            }
        ]
    text = _cli("cache", "ls", "--cache", str(cache)).stdout
    assert f"variant of {index[:19]}" in text
    # blobs shared by digest: the store holds the union of both manifests' blobs, each once
    blobs = {p.name for p in (cache / "blobs" / "sha256").iterdir()}
    tgt = open_readable(f"{v.host}/variants/src", PLAIN)
    wanted = set()
    for d in (v.bf16, v.f32):
        m = Manifest.parse(tgt.fetch_manifest(d)[0])
        wanted |= {Digest(x.digest).hex for x in (m.config, *m.layers)}
    assert wanted <= blobs
    # pinned to the index digest, with the registry unreachable: a hit from the cache's records
    dead = f"127.0.0.1:9/variants/idx-cache@{index}"
    hit = json.loads(
        _cli("pull", dead, "--cache", str(cache), "--variant", "precision=bf16", "--json").stdout
    )
    assert hit["cache"]["state"] == "hit" and hit["digest"] == v.bf16
    off = _cli("pull", dead, "--cache", str(cache), "--variant", "precision=f16", ok=False)
    assert "no variant fits" in off.stderr  # selection still fails closed offline


def test_load_streams_the_selected_entry(variants: Variants) -> None:
    v = variants
    index = _index(v, "variants/idx-load")
    src = f"{v.host}/variants/idx-load@{index}"
    bf = json.loads(_cli("load", src, "--variant", "precision=bf16", "--json").stdout)
    assert bf["digest"] == v.bf16
    auto = json.loads(_cli("load", src, "--json").stdout)
    assert auto["digest"] == v.f32  # --device cpu: the accelerator=cpu entry
    refused = _cli("load", src, "--variant", "engine=vllm", ok=False)
    assert refused.returncode == 1 and "engine: wanted vllm, entry declares none" in refused.stderr
    # with a trusted key the index itself must be signed by it (the entry's chunk table too)
    unsigned = _cli("load", src, "--variant", "precision=bf16", "--trusted-key", str(v.pub), ok=False)
    assert unsigned.returncode == 1 and "the index is not signed by a trusted key" in unsigned.stderr
    signed = _index(v, "variants/idx-load-signed", "--sign-key", str(v.key))
    ok = _cli(
        "load",
        f"{v.host}/variants/idx-load-signed@{signed}",
        "--variant",
        "precision=bf16",
        "--trusted-key",
        str(v.pub),
        "--json",
    )
    doc = json.loads(ok.stdout)
    assert doc["digest"] == v.bf16 and set(doc["verification"].values()) == {"chunks"}


# --------------------------------------------------------------------------- trust
def test_signed_index_and_entries_are_verified_and_an_unsigned_entry_or_other_key_is_refused(
    variants: Variants, tmp_path: Path
) -> None:
    v = variants
    _cli("push", f"{v.host}/variants/src:bf16", f"{v.host}/variants/sig-src:bf16")  # unsigned copy
    signed = json.loads(
        _cli(
            "index",
            "create",
            f"{v.host}/variants/idx-signed:v1",
            f"{v.host}/variants/src:bf16",
            f"{v.host}/variants/src:f32",
            "--variant",
            "2:accelerator=cpu",
            "--sign-key",
            str(v.key),
            "--json",
        ).stdout
    )
    assert set(signed["signed"]) == {v.bf16, v.f32, signed["digest"]}
    ref = f"{v.host}/variants/idx-signed:v1"
    verified = json.loads(_cli("verify", ref, "--key", str(v.pub), "--json").stdout)
    assert verified["digest"] == signed["digest"] and verified["status"] == "verified"
    got = json.loads(
        _cli(
            "pull",
            ref,
            "--cache",
            str(tmp_path / "c"),
            "--key",
            str(v.pub),
            "--variant",
            "precision=bf16",
            "--json",
        ).stdout
    )
    assert got["signature"] == "verified" and got["variant"]["indexSignature"] == "verified"
    out = _cli(
        "pull", ref, str(tmp_path / "dir"), "--key", str(v.pub), "--variant", "precision=f32", "--json"
    )
    assert json.loads(out.stdout)["variant"]["indexSignature"] == "verified"
    other = _cli(
        "pull",
        ref,
        "--cache",
        str(tmp_path / "c2"),
        "--key",
        str(v.other_pub),
        "--variant",
        "precision=bf16",
        ok=False,
    )
    assert other.returncode == 1 and signed["digest"] in other.stderr  # the index is refused first
    # an index signed on its own ('modelpack sign' on an index) whose entry nobody signed
    idx = _cli(
        "index", "create", f"{v.host}/variants/sig-src:idx", f"{v.host}/variants/sig-src:bf16"
    ).stdout.strip()
    sig = json.loads(_cli("sign", f"{v.host}/variants/sig-src:idx", "--key", str(v.key), "--json").stdout)
    assert sig["digest"] == idx and sig["signature"]
    for dest in (["--cache", str(tmp_path / "c3")], [str(tmp_path / "d3")]):
        unsigned = _cli("pull", f"{v.host}/variants/sig-src:idx", *dest, "--key", str(v.pub), ok=False)
        assert unsigned.returncode == 1 and v.bf16 in unsigned.stderr, unsigned.stderr
    with pytest.raises(SignatureRefused):
        from modelpack.mount import NodeCache
        from modelpack.signing.keys import load_public_key

        NodeCache(str(tmp_path / "c4")).pull(
            f"{v.host}/variants/sig-src:idx",
            PLAIN,
            policy=[load_public_key(str(v.pub))],
            variant=VariantSelector.from_options(),
        )


def test_a_tag_of_an_index_moved_back_to_an_older_signed_index_is_refused(
    variants: Variants, tmp_path: Path
) -> None:
    import time

    v = variants
    repo = f"{v.host}/variants/idx-rollback"
    old = _index(v, "variants/idx-rollback", "--sign-key", str(v.key))
    time.sleep(1.1)  # signing times are whole seconds
    new = _cli(
        "index",
        "create",
        f"{repo}:v1",
        f"{v.host}/variants/src:bf16",
        f"{v.host}/variants/src:f32",
        "--variant",
        "2:accelerator=cpu",
        "--variant",
        "1:engine=vllm",
        "--sign-key",
        str(v.key),
    ).stdout.strip()
    assert new != old
    cache = ["--cache", str(tmp_path / "cache"), "--key", str(v.pub), "--variant", "precision=f32"]
    assert json.loads(_cli("pull", f"{repo}:v1", *cache, "--json").stdout)["digest"] == v.f32
    _cli("tag", f"{repo}@{old}", "v1")  # the tag moved back to the older signed index
    back = _cli("pull", f"{repo}:v1", *cache, ok=False)
    assert back.returncode == 1 and old in back.stderr and "Traceback" not in back.stderr, back.stderr
    allowed = _cli("pull", f"{repo}:v1", *cache, "--allow-rollback", "--json")
    assert json.loads(allowed.stdout)["variant"]["index"] == old
