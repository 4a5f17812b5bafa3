"""LoRA adapters as artifacts whose subject is their base: push, list, pull, refusals.

Against the real docker-registry 2.8 (no referrers API: the adapters are found through the
``sha256-<hex>`` tag-schema fallback index that pushing a manifest with a subject maintains).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import shlex
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from modelpack.mediatypes import ARTIFACT_TYPE_MODEL, MEDIA_TYPE_OCI_MANIFEST, ModelSpecConfig

from modelpack.api.adapters import list_adapters, pull_with_adapters, push_adapter
from modelpack.api.transfer import push
from modelpack.cli import main
from modelpack.errors import (
    AdapterBaseMismatchError,
    AdapterError,
    AdapterSubjectError,
    InvalidReferenceError,
    PullError,
    SignatureRefused,
)
from modelpack.oci.descriptor import Manifest
from modelpack.oci.reference import parse_reference
from modelpack.packing.adapter import ANNOTATION_ADAPTER, ANNOTATION_ADAPTER_BASE, ANNOTATION_ADAPTER_NAME
from modelpack.targets.base import bytes_blob_source
from modelpack.targets.fetch import fetch_config, fetch_manifest
from modelpack.targets.opener import open_readable, open_target
from modelpack.testdata.peft_lora import write_lora_adapter
from modelpack.testdata.synthetic import SyntheticSpec, write_checkpoint
from tests.fixtures.registry import RegistryServer
from tests.mount.k8s_images import IMAGE, SERVING

TINY = {"hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1, "num_hidden_layers": 2}
_repo_ids = itertools.count()


@pytest.fixture
def repo(registry: RegistryServer, request: pytest.FixtureRequest) -> str:
    """A fresh repository of the session registry, as ``host/name``."""
    return registry.ref(f"adapters/t{next(_repo_ids)}-{request.node.name[5:30].lower().strip('_')}", None)


def _base(tmp_path: Path, repo: str, tag: str = "base", seed: int = 0) -> tuple[str, str]:
    ckpt = tmp_path / f"ckpt-{seed}"
    write_checkpoint(
        str(ckpt), SyntheticSpec(hidden=64, intermediate=128, vocab=128, heads=2, kv_heads=1, seed=seed)
    )
    return f"{repo}:{tag}", push(str(ckpt), f"{repo}:{tag}").digest


def _adapter(tmp_path: Path, name: str, seed: int = 1) -> Path:
    return Path(write_lora_adapter(str(tmp_path / name), TINY, rank=4, seed=seed))


def _manifest(ref: str) -> Manifest:
    target = open_readable(parse_reference(ref))
    return fetch_manifest(target, parse_reference(ref).identifier)[0]


def _files(d: Path) -> dict[str, str]:
    return {
        str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(d.rglob("*"))
        if p.is_file()
    }


def test_pushed_adapter_names_its_base_as_subject_exactly(tmp_path: Path, repo: str) -> None:
    base_ref, base_digest = _base(tmp_path, repo)
    result = push_adapter(str(_adapter(tmp_path, "sql-lora")), f"{repo}:sql", f"@{base_digest}")
    assert result.base == base_digest and result.name == "sql-lora"
    base_target = open_readable(parse_reference(base_ref))
    base_raw, base_type = base_target.fetch_manifest(base_digest)
    m = _manifest(f"{repo}:sql")
    assert m.subject is not None
    assert (m.subject.media_type, str(m.subject.digest), m.subject.size) == (
        base_type,
        base_digest,
        len(base_raw),
    )
    assert m.artifact_type == ARTIFACT_TYPE_MODEL and m.media_type == MEDIA_TYPE_OCI_MANIFEST
    notes = m.annotations or {}
    assert notes[ANNOTATION_ADAPTER] == "lora" and notes[ANNOTATION_ADAPTER_NAME] == "sql-lora"
    assert notes[ANNOTATION_ADAPTER_BASE] == base_digest
    # no undefined spec key anywhere
    assert not [k for k in notes if k.startswith("org.cncf.model.")]
    kinds = {
        layer.annotations["org.cncf.model.filepath"]: layer.media_type
        for layer in m.layers
        if layer.annotations
    }
    assert kinds == {
        "adapter_config.json": "application/vnd.cncf.model.weight.config.v1.raw",
        "adapter_model.safetensors": "application/vnd.cncf.model.weight.v1.raw",
    }
    # the config is the spec's (validated by the vendored schema when parsed), named after the adapter
    target = open_readable(parse_reference(f"{repo}:sql"))
    cfg = ModelSpecConfig.from_bytes(fetch_config(target, m))
    assert cfg.descriptor.name == "sql-lora" and cfg.config.format == "safetensors"


def test_a_tag_as_base_is_resolved_once_and_pinned(tmp_path: Path, repo: str) -> None:
    _, first = _base(tmp_path, repo, "v1", seed=0)
    result = push_adapter(str(_adapter(tmp_path, "a")), f"{repo}:a", ":v1")
    assert result.base == first and result.base_resolved_from_tag == "v1"
    _, second = _base(tmp_path, repo, "v1", seed=5)  # the tag moves to another base
    assert second != first
    m = _manifest(f"{repo}:a")
    assert m.subject is not None and str(m.subject.digest) == first
    assert [a.name for a in list_adapters(f"{repo}@{first}")[0]] == ["a"]
    assert list_adapters(f"{repo}@{second}")[0] == []


def test_base_must_resolve_be_a_model_and_live_in_the_same_repository(
    tmp_path: Path, repo: str, registry: RegistryServer
) -> None:
    _, base_digest = _base(tmp_path, repo)
    ad = str(_adapter(tmp_path, "a"))
    with pytest.raises(AdapterSubjectError, match="not found"):
        push_adapter(ad, f"{repo}:a", "sha256:" + "0" * 64)
    with pytest.raises(AdapterSubjectError, match="not found"):
        push_adapter(ad, f"{repo}:a", ":no-such-tag")
    with pytest.raises(InvalidReferenceError, match="adapter's repository"):
        push_adapter(ad, f"{repo}:a", registry.ref("elsewhere/base", None) + f"@{base_digest}")
    first = push_adapter(ad, f"{repo}:a", f"@{base_digest}")
    with pytest.raises(AdapterSubjectError, match="itself an adapter"):
        push_adapter(ad, f"{repo}:b", f"@{first.digest}")


def test_hostile_adapter_directories_and_names_are_refused(tmp_path: Path, repo: str) -> None:
    _, base_digest = _base(tmp_path, repo)
    good = _adapter(tmp_path, "good")
    base = f"@{base_digest}"

    def variant(name: str, config: Any) -> str:
        d = tmp_path / name
        d.mkdir()
        (d / "adapter_model.safetensors").write_bytes((good / "adapter_model.safetensors").read_bytes())
        (d / "adapter_config.json").write_bytes(
            config if isinstance(config, bytes) else json.dumps(config).encode()
        )
        return str(d)

    cfg = json.loads((good / "adapter_config.json").read_text())
    cases = {
        "prefix": {**cfg, "peft_type": "PREFIX_TUNING"},
        "rank0": {**cfg, "r": 0},
        "rank-bool": {**cfg, "r": True},
        "modules": {**cfg, "target_modules": [1]},
        "basepath": {**cfg, "base_model_name_or_path": {"path": "/etc"}},
        "dupkeys": b'{"peft_type": "LORA", "r": 8, "r": 4096, "target_modules": ["q_proj"]}',
        "deep": b'{"peft_type": "LORA", "x": ' + b"[" * 64 + b"]" * 64 + b"}",
        "huge": b'{"peft_type": "LORA", "pad": "' + b"x" * 300_000 + b'"}',
    }
    for name, config in cases.items():
        with pytest.raises(AdapterError):
            push_adapter(variant(name, config), f"{repo}:{name}", base)
    nowt = tmp_path / "noweights"
    nowt.mkdir()
    (nowt / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(AdapterError, match=r"adapter_model\.safetensors"):
        push_adapter(str(nowt), f"{repo}:x", base)
    for bad in ("..", "../../etc", ".hidden", "a/b", "x" * 65, "név", "a\nb"):
        with pytest.raises(AdapterError, match="not a safe name"):
            push_adapter(str(good), f"{repo}:x", base, name=bad)
    # base_model_name_or_path is data: a path there is recorded, never opened
    pushed = push_adapter(
        variant("path-as-data", {**cfg, "base_model_name_or_path": "/nonexistent/../../etc"}),
        f"{repo}:ok",
        base,
    )
    assert pushed.base == base_digest


def _plant_adapter(
    repo: str,
    base_digest: str,
    *,
    name: str,
    subject_digest: str | None = None,
    marker_base: str | None = None,
    kind: str = "lora",
) -> str:
    """Push by hand an adapter-looking manifest (what a hostile pusher can write), return its digest."""
    target = open_target(parse_reference(f"{repo}:x"), for_write=True)
    base_raw, base_type = target.fetch_manifest(base_digest)
    from modelpack.oci.descriptor import Descriptor, empty_config_descriptor
    from modelpack.oci.digest import Digest

    cfg = empty_config_descriptor()
    target.push_blob(bytes_blob_source(Descriptor(cfg.media_type, cfg.digest, cfg.size), b"{}"))
    subject_digest = subject_digest or base_digest
    m = Manifest.build(
        cfg,
        [],
        artifact_type=ARTIFACT_TYPE_MODEL,
        subject=Descriptor(base_type, Digest(subject_digest), len(base_raw)),
        annotations={
            ANNOTATION_ADAPTER: kind,
            ANNOTATION_ADAPTER_NAME: name,
            ANNOTATION_ADAPTER_BASE: marker_base or subject_digest,
        },
    )
    return str(target.push_manifest(m.raw, m.media_type, None).digest)


def test_listing_on_a_registry_without_referrers_api_verifies_each_entry(tmp_path: Path, repo: str) -> None:
    _, base_digest = _base(tmp_path, repo)
    a = push_adapter(str(_adapter(tmp_path, "alpha")), f"{repo}:alpha", f"@{base_digest}")
    b = push_adapter(str(_adapter(tmp_path, "beta", seed=2)), f"{repo}:beta", f"@{base_digest}")
    traversal = _plant_adapter(repo, base_digest, name="../../../etc")
    other_kind = _plant_adapter(repo, base_digest, name="delta", kind="prefix")
    disagreeing = _plant_adapter(repo, base_digest, name="gamma", marker_base="sha256:" + "1" * 64)
    adapters, skipped = list_adapters(f"{repo}@{base_digest}")
    assert [(x.name, x.digest) for x in adapters] == [("alpha", a.digest), ("beta", b.digest)]
    assert len(skipped) == 3 and any(traversal in s and "not a safe name" in s for s in skipped)
    assert any(other_kind in s and "is not 'lora'" in s for s in skipped)
    assert any(disagreeing in s and "is not its subject" in s for s in skipped)


def test_pull_into_a_directory_puts_each_adapter_under_adapters_name(tmp_path: Path, repo: str) -> None:
    base_ref, base_digest = _base(tmp_path, repo)
    ad = _adapter(tmp_path, "sql-lora")
    push_adapter(str(ad), f"{repo}:sql", f"@{base_digest}")
    dest = tmp_path / "dest"
    result = pull_with_adapters(base_ref, str(dest))
    assert result.digest == base_digest
    assert [(a.name, a.path) for a in result.adapters] == [("sql-lora", str(dest / "adapters" / "sql-lora"))]
    assert _files(dest / "adapters" / "sql-lora") == _files(ad)
    assert (dest / "config.json").exists() and (dest / "model.safetensors").exists()
    # DEST/adapters planted as a symlink out of DEST: refused, nothing written through it
    elsewhere, dest2 = tmp_path / "elsewhere", tmp_path / "dest2"
    elsewhere.mkdir()
    dest2.mkdir()
    (dest2 / "adapters").symlink_to(elsewhere)
    with pytest.raises(PullError, match="symlink"):
        pull_with_adapters(base_ref, str(dest2))
    assert list(elsewhere.iterdir()) == []


def test_an_adapter_of_another_base_is_refused_naming_both_digests(tmp_path: Path, repo: str) -> None:
    base_ref, base_digest = _base(tmp_path, repo, "one", seed=0)
    _, other_digest = _base(tmp_path, repo, "two", seed=3)
    foreign = push_adapter(str(_adapter(tmp_path, "foreign")), f"{repo}:foreign", f"@{other_digest}")
    dest = tmp_path / "dest"
    with pytest.raises(AdapterBaseMismatchError) as info:
        pull_with_adapters(base_ref, str(dest), with_adapters=False, adapters=[f"{repo}:foreign"])
    assert (
        foreign.digest in str(info.value)
        and other_digest in str(info.value)
        and base_digest in str(info.value)
    )
    assert not dest.exists()  # refused before the first file
    # a subject that does not resolve: the adapter's base is not in its repository
    orphan = _plant_adapter(repo, base_digest, name="orphan", subject_digest="sha256:" + "2" * 64)
    with pytest.raises(AdapterBaseMismatchError):
        pull_with_adapters(base_ref, str(dest), with_adapters=False, adapters=[f"{repo}@{orphan}"])
    from modelpack.packing.adapter_referrers import check_subject_resolves

    with pytest.raises(AdapterSubjectError, match="does not resolve"):
        check_subject_resolves(
            open_readable(parse_reference(repo + ":x")), _manifest(f"{repo}@{orphan}"), "orphan"
        )


def test_pull_into_the_node_cache_checks_every_adapter_against_the_policy(tmp_path: Path, repo: str) -> None:
    from modelpack.mount.cache import NodeCache
    from modelpack.signing import generate_key
    from modelpack.signing.keys import write_keypair

    key = generate_key()
    priv, pub = write_keypair(str(tmp_path / "ci"), key)
    ckpt = tmp_path / "ckpt"
    write_checkpoint(str(ckpt), SyntheticSpec(hidden=64, intermediate=128, vocab=128, heads=2, kv_heads=1))
    base = push(str(ckpt), f"{repo}:base", sign_key=priv)
    signed = push_adapter(
        str(_adapter(tmp_path, "signed")), f"{repo}:signed", f"@{base.digest}", sign_key=priv
    )
    cache = NodeCache(str(tmp_path / "cache"))
    from modelpack.signing.keys import load_public_key

    policy = [load_public_key(pub)]
    result = pull_with_adapters(f"{repo}:base", cache=cache, policy=policy)
    assert [a.name for a in result.adapters] == ["signed"]
    snap = Path(result.adapters[0].path)
    assert (snap / "adapter_model.safetensors").exists() and str(signed.digest) in str(
        cache.resolve_local(f"{repo}@{signed.digest}")
    )
    # an unsigned adapter listed next to it (anyone with push access can list one): left out,
    # reported, and it neither reaches the node nor blocks the signed one
    unsigned = push_adapter(
        str(_adapter(tmp_path, "unsigned", seed=4)), f"{repo}:unsigned", f"@{base.digest}"
    )
    cache2 = NodeCache(str(tmp_path / "cache2"))
    result = pull_with_adapters(f"{repo}:base", cache=cache2, policy=policy)
    assert [a.name for a in result.adapters] == ["signed"]
    assert any(unsigned.digest in s and "left out" in s for s in result.skipped), result.skipped
    assert {e.digest for e in cache2.ls()} == {base.digest, signed.digest}
    # even one named "signed" too: the unsigned duplicate is left out before names are compared
    dup = push_adapter(
        str(_adapter(tmp_path, "dup", seed=6)), f"{repo}:dup", f"@{base.digest}", name="signed"
    )
    assert [
        str(a.descriptor.digest)
        for a in pull_with_adapters(f"{repo}:base", cache=cache2, policy=policy).adapters
    ] == [signed.digest]
    # named by reference, the unsigned adapter refuses the pull before anything is written
    dest = tmp_path / "dest"
    with pytest.raises(SignatureRefused):
        pull_with_adapters(f"{repo}:base", str(dest), policy=policy, adapters=[f"{repo}:unsigned"])
    assert not dest.exists()
    cache3 = NodeCache(str(tmp_path / "cache3"))
    with pytest.raises(SignatureRefused):
        pull_with_adapters(
            f"{repo}:base",
            cache=cache3,
            with_adapters=False,
            adapters=[f"{repo}@{unsigned.digest}"],
            policy=policy,
        )
    assert cache3.ls() == []  # the base included
    # without a policy two adapters named "signed" are ambiguous: refused, naming both
    with pytest.raises(AdapterError, match="named 'signed'") as info:
        pull_with_adapters(f"{repo}:base", cache=cache3)
    assert signed.digest in str(info.value) and dup.digest in str(info.value)


def test_cli_push_base_pull_with_adapters_inspect(tmp_path: Path, repo: str) -> None:
    runner = CliRunner()
    base_ref, base_digest = _base(tmp_path, repo)
    ad = _adapter(tmp_path, "cli-lora")
    out = runner.invoke(main, ["push", str(ad), f"{repo}:cli", "--base", ":base", "--json"])
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout)
    assert doc["base"] == base_digest and doc["adapter"] == "cli-lora" and doc["baseTag"] == "base"
    out = runner.invoke(main, ["inspect", base_ref, "--json"])
    assert out.exit_code == 0, out.output
    assert [a["name"] for a in json.loads(out.stdout)["adapters"]] == ["cli-lora"]
    out = runner.invoke(main, ["inspect", f"{repo}:cli"])
    assert out.exit_code == 0 and f"of base {base_digest}" in out.stdout, out.output
    out = runner.invoke(main, ["audit", repo, "--json"])
    assert out.exit_code == 0, out.output
    versions = {v["tags"][0]: v for v in json.loads(out.stdout)["repositories"][0]["versions"]}
    assert [a["name"] for a in versions["base"]["adapters"]] == ["cli-lora"] and versions["base"][
        "adapter"
    ] is None
    assert versions["cli"]["adapter"] == {"name": "cli-lora", "base": base_digest}
    table = runner.invoke(main, ["audit", repo]).output
    assert "+adapters:cli-lora" in table and f"(adapter of {base_digest[:19]})" in table, table
    dest = tmp_path / "dest"
    out = runner.invoke(main, ["pull", base_ref, str(dest), "--with-adapters", "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout)["adapters"][0]["path"] == str(dest / "adapters" / "cli-lora")
    out = runner.invoke(main, ["pull", base_ref, str(dest), "--with-adapters", "--delete"])
    assert out.exit_code == 2 and "--delete" in out.output
    _, other = _base(tmp_path, repo, "other", seed=9)
    out = runner.invoke(main, ["pull", f"{repo}:other", str(tmp_path / "d2"), "--adapter", f"{repo}:cli"])
    assert (
        out.exit_code == 1
        and base_digest in out.output
        and other in out.output
        and "Traceback" not in out.output
    )
    # pack --base into a layout: the base must be in that layout
    out = runner.invoke(
        main, ["pack", str(ad), f"oci:{tmp_path / 'layout'}:a", "--base", "@sha256:" + "3" * 64]
    )
    assert out.exit_code == 1 and "not found" in out.output, out.output


def test_k8s_init_container_pulls_and_serves_the_adapters(tmp_path: Path, repo: str) -> None:
    runner = CliRunner()
    _, base_digest = _base(tmp_path, repo)
    _, other_digest = _base(tmp_path, repo, "other", seed=9)
    ad = push_adapter(str(_adapter(tmp_path, "sql-lora")), f"{repo}:sql", f"@{base_digest}")
    foreign = push_adapter(str(_adapter(tmp_path, "foreign")), f"{repo}:foreign", f"@{other_digest}")
    base = f"{repo}@{base_digest}"
    out = runner.invoke(
        main,
        [
            "k8s",
            "init-container",
            base,
            "--vllm",
            "--adapter",
            f"{repo}:sql",
            "--cache-path",
            "/cache",
            "--json",
            *("--modelpack-image", IMAGE, "--image", SERVING),
        ],
    )
    assert out.exit_code == 0, out.output
    pod = json.loads(out.stdout)
    (init,) = (c for c in pod["spec"]["initContainers"] if c["name"] == "modelpack-pull")
    assert f"--adapter {repo}@{ad.digest}" in init["command"][-1]  # pinned, pulled by the init container
    server = pod["spec"]["containers"][0]["command"]
    i = server.index("--lora-modules")
    assert server[i + 1] == f"sql-lora=/cache/snapshots/{ad.digest.split(':')[1]}"
    assert server[server.index("--max-lora-rank") + 1] == "8" and "--enable-lora" in server
    # what the init container runs publishes the adapter at that path (below the cache root) and
    # holds it, as the base, until the server's own lease protects it
    cache = tmp_path / "cache"
    argv = shlex.split(init["command"][-1])
    assert argv[:2] == ["modelpack", "pull"] and "--hold" in argv, argv
    argv = [str(cache) if a == "/cache" else a for a in argv[1:]]
    pulled = runner.invoke(main, argv)
    assert pulled.exit_code == 0, pulled.output
    doc = json.loads(pulled.stdout)
    assert doc["adapters"][0]["path"] == str(cache / "snapshots" / ad.digest.split(":")[1])
    assert doc["adapters"][0]["hold"]["until"] and doc["cache"]["hold"]["until"], doc
    gc = runner.invoke(main, ["cache", "gc", "--cache", str(cache), "--keep-versions", "0", "--min-age", "0"])
    assert gc.exit_code == 0, gc.output
    assert (cache / "snapshots" / ad.digest.split(":")[1] / "adapter_model.safetensors").exists()
    # an adapter of the other base: refused, naming both digests, and no YAML
    out = runner.invoke(
        main,
        ["k8s", "init-container", base, "--vllm", "--adapter", f"{repo}:foreign", "--image", SERVING],
        env={"MODELPACK_IMAGE": IMAGE},
    )
    assert out.exit_code == 1 and foreign.digest in out.output and base_digest in out.output, out.output
    assert "apiVersion" not in out.stdout


def test_an_oci_layout_holds_a_base_and_its_adapters(tmp_path: Path) -> None:
    runner = CliRunner()
    ckpt = tmp_path / "ckpt"
    write_checkpoint(str(ckpt), SyntheticSpec(hidden=64, intermediate=128, vocab=128, heads=2, kv_heads=1))
    layout = f"oci:{tmp_path / 'layout'}"
    assert runner.invoke(main, ["pack", str(ckpt), f"{layout}:base"]).exit_code == 0
    out = runner.invoke(
        main, ["pack", str(_adapter(tmp_path, "lay")), f"{layout}:lay", "--base", ":base", "--json"]
    )
    assert out.exit_code == 0, out.output
    adapter_digest = json.loads(out.stdout)["digest"]
    out = runner.invoke(main, ["inspect", f"{layout}:base", "--json"])
    assert [a["digest"] for a in json.loads(out.stdout)["adapters"]] == [adapter_digest], out.output
    result = pull_with_adapters(f"{layout}:base", str(tmp_path / "dest"))
    assert [a.name for a in result.adapters] == ["lay"]
    assert (tmp_path / "dest" / "adapters" / "lay" / "adapter_model.safetensors").exists()


def test_pull_hold_keeps_each_adapter_from_gc_like_the_base(tmp_path: Path, repo: str) -> None:
    """``pull BASE --cache DIR --adapter REF --hold D`` holds the base and each adapter: gc
    (everything may go) keeps them all while the holds last, and removes them once released."""
    from modelpack.mount.cache import NodeCache

    _, base_digest = _base(tmp_path, repo)
    ad = push_adapter(str(_adapter(tmp_path, "sql-lora")), f"{repo}:sql", f"@{base_digest}")
    cache = tmp_path / "cache"
    runner = CliRunner()
    argv = [
        "pull",
        f"{repo}@{base_digest}",
        "--cache",
        str(cache),
        "--adapter",
        f"{repo}:sql",
        "--hold",
        "1h",
    ]
    out = runner.invoke(main, [*argv, "--json"])
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout)
    holds = [doc["cache"]["hold"]["path"], doc["adapters"][0]["hold"]["path"]]
    gc = ["cache", "gc", "--cache", str(cache), "--keep-versions", "0", "--min-age", "0", "--json"]
    kept = json.loads(runner.invoke(main, gc).stdout)
    assert sorted(kept["keptHeld"]) == sorted([base_digest, ad.digest]) and kept["evicted"] == [], kept
    text = runner.invoke(main, argv)  # the human summary says each is held
    assert text.exit_code == 0 and text.output.count("held until") == 2, text.output
    node = NodeCache(str(cache), create=False)
    for hold in [*holds, *(h.path for h in node.leases.holds())]:
        node.release_hold(hold)
    gone = json.loads(runner.invoke(main, gc).stdout)
    assert sorted(gone["evicted"]) == sorted([base_digest, ad.digest]), gone
