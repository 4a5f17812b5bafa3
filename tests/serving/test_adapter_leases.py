"""Adapters under a running engine hold the node cache's reader lease, as a base being loaded does.

The lease is taken by the serving process (the vLLM plugin, for each ``--lora-modules`` path that
is a node-cache snapshot: ``modelpack.serving.adapter_leases``) and held for as long as the engine
serves the adapter: vLLM reads an adapter's files again whenever it reloads it. Here a real
separate process holds the leases, and the real ``cache gc`` runs beside it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner
from modelpack.mount.cache import NodeCache

from modelpack.api.adapters import pull_with_adapters, push_adapter
from modelpack.api.transfer import push
from modelpack.cli import main
from modelpack.errors import ModelpackError
from modelpack.testdata.peft_lora import write_lora_adapter
from modelpack.testdata.synthetic import SyntheticSpec, write_checkpoint
from tests.fixtures.registry import RegistryServer

TINY = {"hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1, "num_hidden_layers": 2}

HOLDER = textwrap.dedent(
    """
    import sys
    from modelpack.serving.adapter_leases import ENGINE_ADAPTER_LEASES as leases
    for arg in sys.argv[1:]:
        name, path = arg.split("=", 1)
        leases.take(name, path)
    print("held", flush=True)
    sys.stdin.read()  # until the test closes it: the engine stops
    """
)


def _gc(cache: str) -> dict[str, list[str]]:
    out = CliRunner().invoke(
        main, ["cache", "gc", "--cache", cache, "--keep-versions", "0", "--min-age", "0", "--json"]
    )
    assert out.exit_code == 0, out.output
    doc: dict[str, list[str]] = json.loads(out.stdout)
    return doc


def _base_with_two_adapters(
    tmp_path: Path, registry: RegistryServer, repo: str
) -> tuple[str, list[str], str]:
    ckpt = tmp_path / "ckpt"
    write_checkpoint(str(ckpt), SyntheticSpec(hidden=64, intermediate=128, vocab=128, heads=2, kv_heads=1))
    base = push(str(ckpt), registry.ref(repo, "base"))
    for name, seed in (("sql-lora", 1), ("chat-lora", 2)):
        adapter = write_lora_adapter(str(tmp_path / name), TINY, rank=4, seed=seed)
        push_adapter(adapter, registry.ref(repo, name), f"@{base.digest}")
    cache = str(tmp_path / "cache")
    pulled = pull_with_adapters(registry.ref(repo, "base"), cache=NodeCache(cache))
    assert sorted(a.name for a in pulled.adapters) == ["chat-lora", "sql-lora"]
    return base.digest, [f"{a.name}={a.path}" for a in pulled.adapters], cache


def test_gc_keeps_the_adapters_an_engine_serves_and_removes_them_once_it_stopped(
    tmp_path: Path, registry: RegistryServer
) -> None:
    """While a serving process holds its adapters' leases, ``cache gc`` (everything may go:
    --keep-versions 0 --min-age 0) keeps both adapter snapshots, reported in use; once that
    process has stopped, the same gc removes them."""
    base, modules, cache = _base_with_two_adapters(tmp_path, registry, "leases/gc")
    adapter_digests = {"sha256:" + os.path.basename(m.split("=", 1)[1]) for m in modules}
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, *modules], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        doc = _gc(cache)
        assert set(doc["keptInUse"]) == adapter_digests, doc
        assert doc["evicted"] == [base]  # nothing leases the base once it is loaded
        for m in modules:
            assert (Path(m.split("=", 1)[1]) / "adapter_model.safetensors").exists()
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(timeout=30)
    assert holder.returncode == 0
    doc = _gc(cache)
    assert set(doc["evicted"]) == adapter_digests, doc
    for m in modules:
        assert not os.path.exists(m.split("=", 1)[1])


def test_a_lease_on_an_adapter_gc_already_removed_fails_and_a_plain_directory_takes_none(
    tmp_path: Path, registry: RegistryServer
) -> None:
    """An adapter snapshot that is gone when the engine starts fails the start (the engine must
    not serve what it cannot lease); a plain directory (no node cache) takes no lease; releasing a
    name lets gc remove it."""
    from modelpack.serving.adapter_leases import AdapterLeases

    _, modules, cache = _base_with_two_adapters(tmp_path, registry, "leases/gone")
    leases = AdapterLeases()
    (first, path), (second, other) = (m.split("=", 1) for m in modules)
    assert leases.take(first, path) is not None
    assert leases.take("plain", str(tmp_path / "sql-lora")) is None  # the PEFT directory pushed
    doc = _gc(cache)
    assert "sha256:" + os.path.basename(other) in doc["evicted"] and not os.path.exists(other)
    assert doc["keptInUse"] == ["sha256:" + os.path.basename(path)] and os.path.exists(path)
    with pytest.raises(ModelpackError, match=os.path.basename(other)):
        leases.take(second, other)
    assert leases.release(first)
    _gc(cache)
    assert not os.path.exists(path)
