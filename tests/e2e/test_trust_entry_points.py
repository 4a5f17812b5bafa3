"""Every way in refuses the same hostile artifact the same way.

One real registry holds a model signed twice under one key (an older version signed in January,
a newer one in June), an unsigned model, and an index of two signed variants. Each hostile case
(an unsigned artifact, a signature by a key the policy does not trust, a tag moved back to the
older signed version after a node cache accepted the newer one) is run through every entry point
that can meet it: ``modelpack pull`` into a directory and into ``--cache``, the Python
``modelpack.pull()``, the KServe storage initializer with and without a file filter in its URI,
and the two checks the vLLM load format runs before vLLM reads a byte. Each must raise the same
typed refusal and write nothing a reader could take for the model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from modelpack.mount import NodeCache
from modelpack.signing import generate_key
from modelpack.signing.keys import write_keypair
from modelpack.signing.sign import sign_artifact

import modelpack
from modelpack.errors import RollbackRefused, SignatureRefused
from modelpack.oci.reference import parse_reference
from modelpack.oci.variant_selection import VariantSelector
from modelpack.targets.opener import TargetOptions, open_target
from modelpack.testdata.synthetic import SyntheticSpec, write_checkpoint

PLAIN = TargetOptions(plain_http=True)
OLDER, NEWER = "2026-01-01T00:00:00Z", "2026-06-01T00:00:00Z"

pytestmark = pytest.mark.timeout(300)


@dataclasses.dataclass
class World:
    registry: Any
    host: str
    older: str  # manifest digests in entry/model
    newer: str
    unsigned: str  # entry/unsigned:v1
    trusted: Path  # policy files
    other: Path
    key: Path
    root: Path
    counter: list[int]

    def fresh(self, name: str) -> Path:
        self.counter[0] += 1
        path = self.root / f"{name}-{self.counter[0]}"
        return path


def _policy(path: Path, pub: str) -> Path:
    path.write_text(f"default:\n  keys: [{pub}]\n")
    return path


def _push_signed(registry: Any, ck: Path, ref: str, key: str, signed_at: str) -> str:
    digest = modelpack.push(str(ck), ref, target_options=PLAIN).digest
    target = open_target(parse_reference(ref), PLAIN, for_write=True)
    sign_artifact(target, target.resolve(digest), key, signed_at=signed_at)
    return digest


@pytest.fixture(scope="module")
def world(registry, tmp_path_factory: pytest.TempPathFactory) -> World:  # type: ignore[no-untyped-def]
    base = tmp_path_factory.mktemp("entry-points")
    key, pub = write_keypair(str(base / "ci"), generate_key())
    _, other_pub = write_keypair(str(base / "other"), generate_key())
    digests = {}
    for seed, name, when in ((1, "older", OLDER), (2, "newer", NEWER)):
        ck = base / f"ck-{name}"
        write_checkpoint(str(ck), SyntheticSpec(seed=seed, hidden=64, intermediate=128, vocab=128, layers=1))
        digests[name] = _push_signed(registry, ck, registry.ref("entry/model", name), key, when)
    ck = base / "ck-unsigned"
    write_checkpoint(str(ck), SyntheticSpec(seed=3, hidden=64, intermediate=128, vocab=128, layers=1))
    unsigned = modelpack.push(str(ck), registry.ref("entry/unsigned", "v1"), target_options=PLAIN).digest
    return World(
        registry,
        registry.host,
        digests["older"],
        digests["newer"],
        unsigned,
        _policy(base / "trusted.yaml", pub),
        _policy(base / "other.yaml", other_pub),
        Path(key),
        base,
        [0],
    )


def _signed_index(world: World, ref: str, precisions: tuple[str, str], signed_at: str) -> str:
    """An index of the two signed versions at ``ref`` with these precisions, itself signed at
    ``signed_at`` (its entries keep their own signatures and signing times)."""
    from modelpack.api.variants import create_index

    made = create_index(
        ref,
        [f"{world.host}/entry/model@{world.older}", f"{world.host}/entry/model@{world.newer}"],
        overrides={0: {"precision": precisions[0]}, 1: {"precision": precisions[1]}},
        target_options=PLAIN,
        progress="off",
    )
    target = open_target(parse_reference(ref), PLAIN, for_write=True)
    sign_artifact(
        target,
        target.resolve(made.digest),
        str(world.key),
        chunk_table=False,
        directory_signature=False,
        signed_at=signed_at,
    )
    return made.digest


def _rolled_back_tag(world: World, cache: Path) -> str:
    """A tag the node cache ``cache`` accepted at the newer version, then moved back to the older
    one (what anyone with push access to the repository can do)."""
    tag = f"rb{world.counter[0]}"
    world.counter[0] += 1
    ref = f"{world.host}/entry/model:{tag}"
    modelpack.tag(f"{world.host}/entry/model@{world.newer}", tag, target_options=PLAIN)
    NodeCache(str(cache)).pull(ref, PLAIN, policy=str(world.trusted))
    modelpack.tag(f"{world.host}/entry/model@{world.older}", tag, target_options=PLAIN)
    return ref


# --------------------------------------------------------------------------- the entry points
# Each takes (world, reference, policy file, node cache or None) and raises what the step raised.


def _cli(*args: str) -> None:
    from click.testing import CliRunner

    from modelpack.cli import main

    res = CliRunner().invoke(main, list(args))
    if res.exit_code == 0:
        return
    # handle_errors prints one line and exits 1; the typed error is named by its message
    text = res.stderr
    if "rollback:" in text:
        raise RollbackRefused("cli", "", "", "", "") from None
    if "signature verification refused" in text:
        raise SignatureRefused("cli", "", text)
    raise AssertionError(f"pull failed otherwise ({res.exit_code}): {text}")


def cli_pull_dir(world: World, ref: str, policy: Path, cache: Path | None) -> None:
    dest = world.fresh("cli-dir")
    try:
        _cli("pull", ref, str(dest), "--plain-http", "--policy", str(policy), "--progress", "off")
    finally:
        assert not dest.exists() or not any(dest.iterdir()), "files written before the refusal"


def cli_pull_cache(world: World, ref: str, policy: Path, cache: Path | None) -> None:
    cache = cache or world.fresh("cli-cache")
    _cli("pull", ref, "--cache", str(cache), "--plain-http", "--policy", str(policy), "--progress", "off")


def python_pull(world: World, ref: str, policy: Path, cache: Path | None) -> None:
    from modelpack.signing.policy import TrustPolicy

    dest = world.fresh("py")
    try:
        modelpack.pull(
            ref, str(dest), target_options=PLAIN, policy=TrustPolicy.load(str(policy)), progress="off"
        )
    finally:
        assert not dest.exists() or not any(dest.iterdir()), "files written before the refusal"


def _kserve(world: World, uri: str, policy: Path, cache: Path | None) -> None:
    from modelpack.serving.kserve.initializer import StorageInitializer, parse_pairs
    from modelpack.serving.kserve.settings import InitializerSettings

    dest = world.fresh("kserve")
    settings = InitializerSettings(
        cache_dir=str(cache) if cache else None, policy_path=str(policy), plain_http=True
    )
    try:
        StorageInitializer(settings, say=lambda _line: None).run(parse_pairs([uri, str(dest)]))
    finally:
        assert not dest.exists() or not any(dest.iterdir()), "files written before the refusal"


def kserve(world: World, ref: str, policy: Path, cache: Path | None) -> None:
    _kserve(world, f"oci://{ref}", policy, cache)


def kserve_filtered(world: World, ref: str, policy: Path, cache: Path | None) -> None:
    _kserve(world, f"oci://{ref}?include=*.json", policy, cache)


def _serving_extra(world: World, ref: str, policy: Path) -> dict[str, Any]:
    parsed = parse_reference(ref)
    target = open_target(parsed, PLAIN)
    digest = str(target.resolve(parsed.identifier).digest)
    return {"source": f"{world.host}/{parsed.repository}@{digest}", "policy": str(policy), "plain_http": True}


def vllm_config_check(world: World, ref: str, policy: Path, cache: Path | None) -> None:
    from modelpack.serving.model_dir import check_before_vllm_reads

    model_dir = world.fresh("vllm-dir")
    model_dir.mkdir()
    check_before_vllm_reads(str(model_dir), _serving_extra(world, ref, policy), environ={})


def vllm_rank_load(world: World, ref: str, policy: Path, cache: Path | None) -> None:
    from modelpack.serving.weights import open_rank_load

    model_dir = world.fresh("vllm-rank")
    model_dir.mkdir()
    open_rank_load(_serving_extra(world, ref, policy), str(model_dir), {}, 1, 0, environ={})


EntryPoint = Callable[[World, str, Path, "Path | None"], None]
EVERY_WAY_IN: list[EntryPoint] = [
    cli_pull_dir,
    cli_pull_cache,
    python_pull,
    kserve,
    kserve_filtered,
    vllm_config_check,
    vllm_rank_load,
]
#: the ways in that consult a node cache's tag history (the others pin digests or keep none)
WITH_A_NODE_CACHE: list[EntryPoint] = [cli_pull_cache, kserve, kserve_filtered]


@pytest.mark.parametrize("way_in", EVERY_WAY_IN, ids=lambda f: f.__name__)
def test_an_unsigned_artifact_is_refused_by_every_way_in(world: World, way_in: EntryPoint) -> None:
    """A policy that requires a trusted key refuses an artifact nobody signed, whichever entry
    point is asked for it."""
    with pytest.raises(SignatureRefused) as info:
        way_in(world, f"{world.host}/entry/unsigned:v1", world.trusted, None)
    assert not isinstance(info.value, RollbackRefused)


@pytest.mark.parametrize("way_in", EVERY_WAY_IN, ids=lambda f: f.__name__)
def test_a_signature_by_an_untrusted_key_is_refused_by_every_way_in(world: World, way_in: EntryPoint) -> None:
    """A model signed by a key the policy does not name is refused, whichever entry point."""
    with pytest.raises(SignatureRefused) as info:
        way_in(world, f"{world.host}/entry/model:newer", world.other, None)
    assert not isinstance(info.value, RollbackRefused)


@pytest.mark.parametrize("way_in", WITH_A_NODE_CACHE, ids=lambda f: f.__name__)
def test_a_tag_moved_back_to_an_older_signed_version_is_refused_by_every_way_in_with_a_node_cache(
    world: World, way_in: EntryPoint
) -> None:
    """Once a node cache accepted the newer signed version for a tag, the tag moved back to the
    older signed version is a rollback for every entry point using that cache, a file filter in
    a KServe URI included."""
    cache = world.fresh("cache")
    ref = _rolled_back_tag(world, cache)
    with pytest.raises(RollbackRefused):
        way_in(world, ref, world.trusted, cache)


def test_the_python_pull_resolves_a_variant_index_and_verifies_the_entry(
    world: World, tmp_path: Path
) -> None:
    """``modelpack.pull(variant=…)`` takes the index entry the selector names, verified under the
    policy (index and entry), and says which entry it took."""
    from modelpack.signing.policy import TrustPolicy

    _signed_index(world, f"{world.host}/entry/index:v1", ("f32", "bf16"), NEWER)
    selector = VariantSelector.from_options(["precision=bf16"])
    result = modelpack.pull(
        f"{world.host}/entry/index:v1",
        str(tmp_path / "m"),
        target_options=PLAIN,
        policy=TrustPolicy.load(str(world.trusted)),
        variant=selector,
        progress="off",
    )
    assert result.digest == world.newer
    assert (tmp_path / "m" / "config.json").is_file()
    # the same index under a policy of another key: refused before a file is written
    with pytest.raises(SignatureRefused):
        modelpack.pull(
            f"{world.host}/entry/index:v1",
            str(tmp_path / "n"),
            target_options=PLAIN,
            policy=TrustPolicy.load(str(world.other)),
            variant=selector,
            progress="off",
        )
    assert not (tmp_path / "n").exists() or not any((tmp_path / "n").iterdir())


def test_a_filtered_pull_through_a_node_cache_raises_the_tags_bar(world: World) -> None:
    """A KServe URI with a file filter, given a node cache, records the version it delivered in
    the cache's tag history: moving the tag back afterwards is refused for every later pull."""
    cache = world.fresh("cache")
    tag = f"bar{world.counter[0]}"
    ref = f"{world.host}/entry/model:{tag}"
    modelpack.tag(f"{world.host}/entry/model@{world.newer}", tag, target_options=PLAIN)
    dest = world.fresh("kserve-ok")
    from modelpack.serving.kserve.initializer import StorageInitializer, parse_pairs
    from modelpack.serving.kserve.settings import InitializerSettings

    settings = InitializerSettings(cache_dir=str(cache), policy_path=str(world.trusted), plain_http=True)
    StorageInitializer(settings, say=lambda _line: None).run(
        parse_pairs([f"oci://{ref}?include=*.json", str(dest)])
    )
    assert (dest / "config.json").is_file() and not list(dest.glob("*.safetensors"))
    modelpack.tag(f"{world.host}/entry/model@{world.older}", tag, target_options=PLAIN)
    with pytest.raises(RollbackRefused):
        kserve(world, ref, world.trusted, cache)
    with pytest.raises(RollbackRefused):
        cli_pull_cache(world, ref, world.trusted, cache)


def test_a_tag_of_an_index_moved_back_is_refused_by_the_step_with_a_node_cache(world: World) -> None:
    """The index's own signing time is checked against the tag's history: a tag moved back to
    an index signed earlier is refused before an entry is selected, also outside the cache's
    own pull."""
    from modelpack.mount.resolve import resolve_trusted
    from modelpack.signing.policy import TrustPolicy

    digests = [
        _signed_index(world, f"{world.host}/entry/index-rb:{name}", ("f16", other), at)
        for name, other, at in (("older", "f32", OLDER), ("newer", "bf16", NEWER))
    ]
    assert digests[0] != digests[1]
    ref = f"{world.host}/entry/index-rb:prod"
    policy = TrustPolicy.load(str(world.trusted))
    cache = NodeCache(str(world.fresh("cache")))
    selector = VariantSelector.from_options(["precision=f16"])
    modelpack.tag(f"{world.host}/entry/index-rb@{digests[1]}", "prod", target_options=PLAIN)
    first = resolve_trusted(ref, policy=policy, selector=selector, target_options=PLAIN, cache=cache)
    assert first.digest == world.older and first.variant is not None
    first.accept()
    modelpack.tag(f"{world.host}/entry/index-rb@{digests[0]}", "prod", target_options=PLAIN)
    with pytest.raises(RollbackRefused):
        resolve_trusted(ref, policy=policy, selector=selector, target_options=PLAIN, cache=cache)
    # without a node cache there is no history to compare with: the older index is only verified
    again = resolve_trusted(ref, policy=policy, selector=selector, target_options=PLAIN)
    assert again.digest == world.older and again.verification is not None
