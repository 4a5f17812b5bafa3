"""A standalone TP rank's column-split shares from a real registry, through the CLI: by default
(``--column-reads local``) the covering chunks, as before (a range per row costs the registry
~0.4 ms); with ``--column-reads always`` only the rank's columns, one multipart range per row,
checked against the signed column blocks — the same tensors either way."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from modelpack.loader import LoaderOptions, LoadStats, load_state_dict
from modelpack.signing.keys import load_public_key

from modelpack.cli import main
from modelpack.targets.options import TargetOptions
from modelpack.testdata.synthetic import SyntheticSpec, write_checkpoint
from tests.fixtures.registry import RegistryServer
from tests.loader_helpers import expected_shard, reference_tensors


def _cli(*args: str) -> Any:
    res = CliRunner().invoke(main, list(args))
    assert res.exit_code == 0, res.output
    return res.output


@pytest.fixture(scope="module")
def signed(registry: RegistryServer, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, Path]:
    d = tmp_path_factory.mktemp("columns-registry")
    spec = SyntheticSpec(hidden=512, intermediate=1536, layers=2, heads=8, kv_heads=8, vocab=1024)
    write_checkpoint(str(d / "ckpt"), spec)
    ref = registry.ref("columns", "v1")
    doc = json.loads(_cli("pack", str(d / "ckpt"), ref, "--plain-http", "--json"))
    digest = doc["digest"]
    _cli("keygen", "--out", str(d / "ci"))
    _cli("sign", ref, "--key", str(d / "ci.key"), "--plain-http", "--chunk-size", "65536")
    return d / "ckpt", f"{registry.host}/columns@{digest}", d / "ci.pub"


@pytest.mark.parametrize("policy", ["local", "always"])
def test_a_standalone_rank_reads_its_columns_from_a_registry_only_when_asked(
    signed: tuple[Path, str, Path], policy: str
) -> None:
    ckpt, pinned, pub = signed
    common = ["--plain-http", "--trusted-key", str(pub), "--tp-size", "2", "--tp-rank", "1"]
    doc = json.loads(_cli("load", pinned, *common, "--column-reads", policy, "--json"))
    d1 = doc["bytesBySplit"]["dim1"]
    assert d1["tensorBytes"] > 0 and d1["planned"] == d1["tensorBytes"] // 2, d1
    if policy == "always":
        assert d1["read"] == d1["planned"], d1
        assert doc["bytesRead"] <= 0.55 * doc["modelBytes"], doc["bytesRead"]
    else:
        assert d1["read"] == d1["tensorBytes"], d1
    # the Python API, same policy: the tensors are safetensors' own slices
    stats = LoadStats()
    sd = load_state_dict(
        pinned,
        tp_size=2,
        tp_rank=1,
        trusted_keys=[load_public_key(str(pub))],
        target_options=TargetOptions(plain_http=True),
        options=LoaderOptions(column_reads=policy),
        stats=stats,
    )
    assert stats.plan is not None and stats.bytes_read == doc["bytesRead"]
    ref = reference_tensors(ckpt)
    for t in stats.plan.tensors:
        assert torch.equal(sd[t.name], expected_shard(ref[t.name], t.rule, 2, 1)), t.name
