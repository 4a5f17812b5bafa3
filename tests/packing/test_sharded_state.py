"""vLLM's ``sharded_state`` layout as a variant, without vLLM.

A synthetic sharded_state checkpoint — ``model-rank-R-part-P.safetensors`` as vLLM's
``save_sharded_state`` names them, every rank's tensors different — is packed, pulled into a node
cache or read from an OCI layout, and loaded rank by rank through the loader library and through
the ``modelpack`` load format's rank load (``serving.weights``). vLLM itself runs in
``tests/serving/test_vllm_tp2.py``.

What must hold: the manifest names the layout and the TP size, each rank file's layer its rank;
each rank reads exactly its own files (bytes counted by the loader, and a layout holding none of
the other rank's blobs still loads); ambiguous or incomplete rank-file sets are refused at pack
time naming the file or rank; a manifest whose tp-size or rank annotations lie, a rank file
swapped on the node, an engine of another TP size and a load asking for the other layout are
refused before any tensor is handed out.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
from modelpack.loader import LoadStats, iter_tensors, load_state_dict
from modelpack.mediatypes.sharded_state import ANNOTATION_SHARDED_STATE_RANK
from modelpack.mediatypes.variants import ANNOTATION_VARIANT_LAYOUT, ANNOTATION_VARIANT_TP_SIZE
from modelpack.mount.cache import NodeCache
from safetensors.torch import load_file, save_file

from modelpack import api
from modelpack.errors import (
    DigestMismatchError,
    LayoutMismatchError,
    MissingRankError,
    ServingConfigError,
    ServingError,
    ShardedStateError,
    SourceError,
    TpSizeMismatchError,
)
from modelpack.oci.descriptor import Manifest
from modelpack.oci.digest import sha256_fileobj
from modelpack.serving.sharded_state import copy_into_state
from modelpack.serving.weights import open_rank_load
from tests.loader_helpers import Layout, pack_layout

TP = 2
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "float32"}


def rank_state(rank: int) -> dict[str, torch.Tensor]:
    """What one rank's vLLM model would save: fused per-rank shards plus replicated norms."""
    g = torch.Generator().manual_seed(100 + rank)
    return {
        "model.embed_tokens.weight": torch.randn(64, 32, generator=g),
        "model.layers.0.self_attn.qkv_proj.weight": torch.randn(48, 32, generator=g),
        "model.layers.0.self_attn.o_proj.weight": torch.randn(32, 16, generator=g),
        "model.layers.0.mlp.gate_up_proj.weight": torch.randn(128, 32, generator=g),
        "model.layers.0.mlp.down_proj.weight": torch.randn(32, 64, generator=g),
        "model.norm.weight": torch.ones(32),
        "lm_head.weight": torch.randn(64, 32, generator=g),
    }


def write_sharded(directory: Path, ranks: tuple[int, ...] = (0, 1)) -> Path:
    """Two parts per rank, split as vLLM's ``max_size`` would, plus config and tokenizer files."""
    directory.mkdir(parents=True, exist_ok=True)
    for rank in ranks:
        items = sorted(rank_state(rank).items())
        half = len(items) // 2
        for part, chunk in enumerate((items[:half], items[half:])):
            save_file(dict(chunk), str(directory / f"model-rank-{rank}-part-{part}.safetensors"))
    (directory / "config.json").write_text(json.dumps(CONFIG))
    (directory / "tokenizer_config.json").write_text("{}")
    return directory


def rank_files(directory: Path, rank: int) -> list[Path]:
    return sorted(directory.glob(f"model-rank-{rank}-part-*.safetensors"))


@pytest.fixture
def sharded(tmp_path: Path) -> Path:
    return write_sharded(tmp_path / "sharded")


@pytest.fixture
def layout(sharded: Path, tmp_path: Path) -> Layout:
    return pack_layout(sharded, tmp_path / "layout")


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return str(sha256_fileobj(f)[0])


# --- packing -------------------------------------------------------------------------------------


def test_pack_names_the_layout_the_tp_size_and_each_rank_files_rank(sharded: Path, layout: Layout) -> None:
    m = layout.manifest
    assert (m.annotations or {})[ANNOTATION_VARIANT_LAYOUT] == "sharded_state"
    assert (m.annotations or {})[ANNOTATION_VARIANT_TP_SIZE] == "2"
    ranks = {}
    for layer in m.layers:
        ann = layer.annotations or {}
        rel = ann["org.cncf.model.filepath"]
        if rel.endswith(".safetensors"):
            ranks[rel] = ann[ANNOTATION_SHARDED_STATE_RANK]
            # every rank file is a raw weight layer as today: its digest is the file's sha256
            assert layer.media_type == "application/vnd.cncf.model.weight.v1.raw"
            assert str(layer.digest) == _sha256(sharded / rel)
        else:
            assert ANNOTATION_SHARDED_STATE_RANK not in ann, rel
    assert ranks == {
        "model-rank-0-part-0.safetensors": "0",
        "model-rank-0-part-1.safetensors": "0",
        "model-rank-1-part-0.safetensors": "1",
        "model-rank-1-part-1.safetensors": "1",
    }


def test_a_canonical_checkpoint_gets_no_layout_annotations(checkpoint: Path, tmp_path: Path) -> None:
    lay = pack_layout(checkpoint, tmp_path / "canonical")
    assert ANNOTATION_VARIANT_LAYOUT not in (lay.manifest.annotations or {})
    assert all(ANNOTATION_SHARDED_STATE_RANK not in (x.annotations or {}) for x in lay.manifest.layers)


def test_pack_refuses_a_missing_rank_naming_it(tmp_path: Path) -> None:
    src = write_sharded(tmp_path / "gap", ranks=(0, 2))
    with pytest.raises(MissingRankError) as info:
        api.pack(str(src), f"oci:{tmp_path / 'out'}:v1")
    assert info.value.rank == 1 and info.value.tp_size == 3
    assert "rank 1" in str(info.value)
    assert str(src) in str(info.value)  # refused by the directory's check, before any file was hashed
    index = tmp_path / "out" / "index.json"
    assert not index.exists() or not json.loads(index.read_text()).get("manifests")  # nothing published


@pytest.mark.parametrize(
    "name",
    [
        "model-rank-01-part-0.safetensors",  # leading zero: rank 1 twice over
        "Model-Rank-1-part-0.safetensors",  # vLLM's glob is case-sensitive
        "model-rank-1-part-0.safetensors.bak",
        "model-rank-x-part-0.safetensors",
        "sub/model-rank-1-part-2.safetensors",  # vLLM reads rank files only at the top
        "model-pp-0-tp-0-part-0.safetensors",  # pipeline-parallel names: not supported
    ],
)
def test_pack_refuses_an_ambiguous_rank_file_name(sharded: Path, tmp_path: Path, name: str) -> None:
    target = sharded / name
    target.parent.mkdir(parents=True, exist_ok=True)
    save_file({"x": torch.zeros(2)}, str(target))
    with pytest.raises(ShardedStateError) as info:
        api.pack(str(sharded), f"oci:{tmp_path / 'out'}:v1")
    assert info.value.file == name and name in str(info.value)


def test_pack_refuses_rank_files_mixed_with_canonical_weights(sharded: Path, tmp_path: Path) -> None:
    save_file({"x": torch.zeros(2)}, str(sharded / "model.safetensors"))
    with pytest.raises(ShardedStateError, match=r"mixed with other weight files \['model.safetensors'\]"):
        api.pack(str(sharded), f"oci:{tmp_path / 'out'}:v1")


def test_pack_refuses_a_tensor_twice_in_one_rank(sharded: Path, tmp_path: Path) -> None:
    save_file({"model.norm.weight": torch.ones(32)}, str(sharded / "model-rank-1-part-2.safetensors"))
    with pytest.raises(ShardedStateError, match=r"'model\.norm\.weight' of rank 1 is in both"):
        api.pack(str(sharded), f"oci:{tmp_path / 'out'}:v1")


def test_pack_refuses_ranks_from_different_saves(sharded: Path, tmp_path: Path) -> None:
    save_file({"other.weight": torch.ones(4)}, str(sharded / "model-rank-1-part-2.safetensors"))
    with pytest.raises(ShardedStateError, match="rank 1's tensors differ from rank 0's"):
        api.pack(str(sharded), f"oci:{tmp_path / 'out'}:v1")


# --- loading: each rank its own files ---------------------------------------------------------------


def _expected(sharded: Path, rank: int) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in rank_files(sharded, rank):
        out.update(load_file(str(f)))
    return out


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name, t in want.items():
        assert torch.equal(got[name], t), name


def test_each_rank_of_a_snapshot_reads_only_its_own_files(
    sharded: Path, layout: Layout, tmp_path: Path
) -> None:
    snap = NodeCache(str(tmp_path / "cache")).pull(layout.ref).path
    total = sum(f.stat().st_size for f in sharded.glob("model-rank-*.safetensors"))
    per_rank = {}
    for rank in range(TP):
        stats = LoadStats()
        sd = load_state_dict(
            snap, tp_size=TP, tp_rank=rank, layout="sharded_state", expected_digest=layout.digest, stats=stats
        )
        _assert_same(sd, _expected(sharded, rank))
        own = {f.name: f.stat().st_size for f in rank_files(sharded, rank)}
        # the loader's own accounting: every byte of this rank's files (headers included), no other file
        assert set(stats.per_file_bytes) == set(own)
        assert (
            stats.bytes_read
            == sum(own.values())
            == stats.bytes_by_split["replicate"]["read"] + sum(stats.bytes_by_split["header"].values())
        )
        assert set(stats.verification) == set(own)
        per_rank[rank] = stats.bytes_read
    assert sum(per_rank.values()) == total
    for rank, n in per_rank.items():
        assert 0.45 < n / total < 0.55, (rank, n, total)  # ≈ 1/TP of the model


def test_a_streamed_rank_needs_none_of_the_other_ranks_blobs(sharded: Path, layout: Layout) -> None:
    """Rank 0 streams from a layout that holds no byte of rank 1 (its blobs deleted): it loads,
    verified whole against each layer digest; rank 1 cannot (so the deletion was real)."""
    for layer in layout.manifest.layers:
        if (layer.annotations or {}).get(ANNOTATION_SHARDED_STATE_RANK) == "1":
            os.unlink(layout.target.blob_path(layer.digest))
    stats = LoadStats()
    sd = load_state_dict(layout.ref, tp_size=TP, tp_rank=0, layout="sharded_state", stats=stats)
    _assert_same(sd, _expected(sharded, 0))
    assert set(stats.verification.values()) == {"whole"}
    own = sum(f.stat().st_size for f in rank_files(sharded, 0))
    # its files once, plus each file's header read once more to plan (streamed whole-layer reads)
    assert own <= stats.bytes_read <= own + stats.bytes_by_split["header"]["read"]
    with pytest.raises(SourceError, match="No such file"):
        load_state_dict(layout.ref, tp_size=TP, tp_rank=1, layout="sharded_state")


# --- refusals ---------------------------------------------------------------------------------------


def test_an_engine_of_another_tp_size_is_refused_naming_both(layout: Layout) -> None:
    for engine_tp in (1, 4):
        with pytest.raises(TpSizeMismatchError) as info:
            load_state_dict(layout.ref, tp_size=engine_tp, tp_rank=0, layout="sharded_state")
        assert (info.value.artifact_tp_size, info.value.engine_tp_size) == (2, engine_tp)
        assert f"size 2, the engine runs tensor-parallel size {engine_tp}" in str(info.value)


def test_the_other_layout_is_refused_both_ways(layout: Layout, checkpoint: Path, tmp_path: Path) -> None:
    with pytest.raises(LayoutMismatchError) as info:
        load_state_dict(layout.ref, tp_size=TP, tp_rank=0)  # canonical is the default
    assert (info.value.requested, info.value.found) == ("canonical", "sharded_state")
    canonical = pack_layout(checkpoint, tmp_path / "canonical")
    with pytest.raises(LayoutMismatchError) as info:
        load_state_dict(canonical.ref, tp_size=1, tp_rank=0, layout="sharded_state")
    assert (info.value.requested, info.value.found) == ("sharded_state", "canonical")


def _republish(
    lay: Layout, tag: str, *, annotations: dict[str, str] | None = None, ranks: dict[str, str] | None = None
) -> str:
    """The same blobs under a manifest whose annotations were edited (what a hostile pusher sends)."""
    m = lay.manifest
    layers = []
    for layer in m.layers:
        rel = (layer.annotations or {}).get("org.cncf.model.filepath", "")
        if ranks and rel in ranks:
            layer = dataclasses.replace(
                layer, annotations={**(layer.annotations or {}), ANNOTATION_SHARDED_STATE_RANK: ranks[rel]}
            )
        layers.append(layer)
    forged = Manifest.build(
        m.config,
        layers,
        artifact_type=m.artifact_type,
        annotations={**(m.annotations or {}), **(annotations or {})},
    )
    return str(lay.target.push_manifest(forged.raw, forged.media_type, tag).digest)


@pytest.mark.parametrize("lie", ["4", "1"])
def test_a_lying_tp_size_annotation_is_refused(layout: Layout, lie: str) -> None:
    digest = _republish(layout, "lie", annotations={ANNOTATION_VARIANT_TP_SIZE: lie})
    with pytest.raises(ShardedStateError) as info:
        load_state_dict(f"oci:{layout.path}@{digest}", tp_size=int(lie), tp_rank=0, layout="sharded_state")
    assert f"says {lie}, but the rank files are for ranks 0..1" in str(info.value)


def test_a_rank_annotation_that_disagrees_with_the_file_name_is_refused(layout: Layout) -> None:
    digest = _republish(
        layout,
        "swapped",
        ranks={"model-rank-0-part-0.safetensors": "1", "model-rank-1-part-0.safetensors": "0"},
    )
    with pytest.raises(ShardedStateError) as info:
        load_state_dict(f"oci:{layout.path}@{digest}", tp_size=TP, tp_rank=0, layout="sharded_state")
    assert info.value.file == "model-rank-0-part-0.safetensors"
    assert "annotated as rank 1, its file name says rank 0" in str(info.value)


def test_a_rank_file_swapped_with_another_ranks_on_the_node_is_refused(
    layout: Layout, tmp_path: Path
) -> None:
    """Rank 0's part 0 in the snapshot replaced by rank 1's part 0 (same tensor names and shapes):
    the file is no longer the layer's blob, the digest check refuses it before any tensor lands."""
    snap = Path(NodeCache(str(tmp_path / "cache")).pull(layout.ref).path)
    a, b = snap / "model-rank-0-part-0.safetensors", snap / "model-rank-1-part-0.safetensors"
    os.chmod(snap, 0o755)
    tmp = snap / "swap.tmp"
    os.rename(a, tmp)
    os.rename(b, a)
    os.rename(tmp, b)
    got: list[str] = []
    with pytest.raises(DigestMismatchError) as info:
        for name, _ in iter_tensors(
            str(snap), tp_size=TP, tp_rank=0, layout="sharded_state", expected_digest=layout.digest
        ):
            got.append(name)
    assert "layer model-rank-0-part-0.safetensors" in str(info.value)
    assert not got


# --- the modelpack load format's rank load (no vLLM) -------------------------------------------------


def test_the_vllm_rank_load_copies_its_own_files_into_the_parameters(
    sharded: Path, layout: Layout, tmp_path: Path
) -> None:
    snap = NodeCache(str(tmp_path / "cache")).pull(layout.ref).path
    extra = {
        "expected_digest": layout.digest,
        "layout": "sharded_state",
        "events": str(tmp_path / "ev.jsonl"),
    }
    for rank in range(TP):
        want = _expected(sharded, rank)
        params = {name: torch.full_like(t, float("nan")) for name, t in want.items()}
        rl = open_rank_load(extra, snap, CONFIG, TP, rank, environ={})
        copied = copy_into_state(dict(params), rl.tensors(), where=snap)
        assert sorted(copied) == sorted(want)
        for name, t in want.items():
            assert torch.equal(params[name], t), name
        summary = rl.summary()
        assert summary["layout"] == "sharded_state" and summary["tp_rank"] == rank
        assert summary["files"] == [f.name for f in rank_files(sharded, rank)]
        assert summary["bytes_read"] == sum(f.stat().st_size for f in rank_files(sharded, rank))
    with pytest.raises(TpSizeMismatchError):
        list(open_rank_load(extra, snap, CONFIG, 4, 0, environ={}).tensors())
    with pytest.raises(LayoutMismatchError):
        list(open_rank_load({**extra, "layout": "canonical"}, snap, CONFIG, TP, 0, environ={}).tensors())
    with pytest.raises(ServingConfigError, match="layout must be one of"):
        open_rank_load({**extra, "layout": "sharded"}, snap, CONFIG, TP, 0, environ={})


def test_copy_into_state_refuses_what_vllms_parameters_cannot_take() -> None:
    def state() -> dict[str, torch.Tensor]:
        return {"a": torch.zeros(4, 2), "b": torch.zeros(3)}

    with pytest.raises(ServingError, match="'c' is not a parameter"):
        copy_into_state(state(), [("c", torch.zeros(1))], where="m")
    with pytest.raises(ServingError, match=r"parameters no sharded_state file of this rank holds: \['b'\]"):
        copy_into_state(state(), [("a", torch.ones(4, 2))], where="m")
    with pytest.raises(ServingError, match="larger than the parameter"):
        copy_into_state(state(), [("a", torch.ones(5, 2)), ("b", torch.ones(3))], where="m")
    with pytest.raises(ServingError, match="'a' was filled twice"):
        copy_into_state(state(), [("a", torch.ones(4, 2)), ("a", torch.ones(4, 2))], where="m")
    a, b = torch.zeros(4, 2), torch.zeros(3)  # a parameter vLLM padded by a row: its leading part is filled
    copy_into_state({"a": a, "b": b}, [("a", torch.ones(3, 2)), ("b", torch.ones(3))], where="m")
    assert bool(a[:3].eq(1).all()) and bool(a[3].eq(0).all()) and bool(b.eq(1).all())


# --- as a variant of an index -----------------------------------------------------------------------


def test_an_index_of_canonical_and_sharded_state_selects_by_tp_size(
    sharded: Path, checkpoint: Path, tmp_path: Path
) -> None:
    """``modelpack index create`` over the canonical build and this sharded_state build: a TP=2
    node gets the sharded_state entry (and loads its own rank's files through the index), any other
    TP size the canonical one."""
    from modelpack.loader import LoaderOptions

    from modelpack.api.variants import create_index
    from modelpack.oci.variant_index import parse_variant_index
    from modelpack.oci.variant_selection import VariantSelector
    from modelpack.targets.layout import OCILayoutTarget

    store = tmp_path / "store"
    canonical = pack_layout(checkpoint, store, tag="canonical")
    shard = pack_layout(sharded, store, tag="tp2")
    created = create_index(f"oci:{store}:model", [canonical.ref, shard.ref], progress="off")
    raw, media_type = OCILayoutTarget(str(store)).fetch_manifest("model")
    index = parse_variant_index(raw, media_type)
    assert str(index.index.digest) == created.digest
    by_digest = {str(e.descriptor.digest): dict(e.fields) for e in index.entries}
    assert by_digest[shard.digest]["layout"] == "sharded_state" and by_digest[shard.digest]["tp-size"] == "2"
    assert VariantSelector(tp_size=2).select(index).digest == shard.digest
    for tp in (1, 4):
        assert VariantSelector(tp_size=tp).select(index).digest == canonical.digest
    stats = LoadStats()
    sd = load_state_dict(
        f"oci:{store}@{created.digest}",
        tp_size=TP,
        tp_rank=1,
        layout="sharded_state",
        options=LoaderOptions(variant=VariantSelector(tp_size=TP)),
        stats=stats,
    )
    _assert_same(sd, _expected(sharded, 1))
    assert stats.digest == shard.digest


# --- the CLI -----------------------------------------------------------------------------------------


def test_load_cli_reports_each_ranks_own_files_and_refuses_another_tp_size(
    sharded: Path, layout: Layout
) -> None:
    from click.testing import CliRunner

    from modelpack.cli import main

    runner = CliRunner()
    for rank in range(TP):
        out = runner.invoke(
            main,
            [
                "load",
                layout.ref,
                "--layout",
                "sharded_state",
                "--tp-size",
                "2",
                "--tp-rank",
                str(rank),
                "--json",
            ],
        )
        assert out.exit_code == 0, out.output
        doc = json.loads(out.stdout)
        assert doc["layout"] == "sharded_state" and doc["digest"] == layout.digest
        assert sorted(doc["bytesByFile"]) == [f.name for f in rank_files(sharded, rank)]
        assert doc["bytesRead"] == sum(doc["bytesByFile"].values())
    out = runner.invoke(main, ["load", layout.ref, "--layout", "sharded_state", "--tp-size", "4"])
    assert out.exit_code == 1
    assert "split for tensor-parallel size 2, the engine runs tensor-parallel size 4" in out.stderr
    assert "Traceback" not in out.output
    out = runner.invoke(main, ["load", layout.ref, "--tp-size", "2"])
    assert out.exit_code == 1 and "the artifact's layout is 'sharded_state'" in out.stderr


def test_inspect_shows_the_variant_a_manifest_declares(
    layout: Layout, checkpoint: Path, tmp_path: Path
) -> None:
    from click.testing import CliRunner

    from modelpack.cli import main

    runner = CliRunner()
    out = runner.invoke(main, ["inspect", layout.ref, "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout)["variant"] == {"layout": "sharded_state", "tp-size": "2"}
    out = runner.invoke(main, ["inspect", layout.ref])
    assert "Variant:       tp-size=2, layout=sharded_state" in out.stdout
    canonical = pack_layout(checkpoint, tmp_path / "canonical")
    out = runner.invoke(main, ["inspect", canonical.ref, "--json"])
    assert "variant" not in json.loads(out.stdout)


def test_vllms_config_hook_refuses_another_tp_size_or_layout_before_workers_start(
    layout: Layout, tmp_path: Path
) -> None:
    """``check_layout_before_start`` (run by the plugin when vLLM builds its config, with vLLM's
    ``--tensor-parallel-size``) on the pulled snapshot: the matching start passes, another TP size,
    the default layout and a manifest whose tp-size lies are refused, each with a config-stage event."""
    from modelpack.serving.sharded_state import check_layout_before_start

    cache = NodeCache(str(tmp_path / "cache"))
    snap = cache.pull(layout.ref).path
    events = tmp_path / "events.jsonl"
    extra = {"expected_digest": layout.digest, "layout": "sharded_state", "events": str(events)}
    check_layout_before_start(snap, json.dumps(extra), tp_size=TP, environ={})
    with pytest.raises(TpSizeMismatchError):
        check_layout_before_start(snap, extra, tp_size=4, environ={})
    with pytest.raises(LayoutMismatchError):
        check_layout_before_start(snap, {**extra, "layout": "canonical"}, tp_size=TP, environ={})
    lie = _republish(layout, "lie", annotations={ANNOTATION_VARIANT_TP_SIZE: "1"})
    lying = cache.pull(f"oci:{layout.path}@{lie}").path
    with pytest.raises(ShardedStateError, match=r"says 1, but the rank files are for ranks 0\.\.1"):
        check_layout_before_start(lying, {**extra, "expected_digest": lie}, tp_size=1, environ={})
    refused = [json.loads(line) for line in events.read_text().splitlines()]
    assert {e["event"] for e in refused} == {"serving.refused"}
    assert [e["stage"] for e in refused] == ["config"] * 3
    assert [e["reason"].split(":")[0] for e in refused] == [
        "TpSizeMismatchError",
        "LayoutMismatchError",
        "ShardedStateError",
    ]
