"""``cache lora-args``: it reads a node cache and never creates one, its README recipe runs as
written, and it hands vLLM only adapters that passed the trust the base passed on this node.

Against the real docker-registry of the session; no vLLM needed (the flags are checked as text;
``test_adapters_vllm.py`` starts vLLM with them).
"""

from __future__ import annotations

import itertools
import json
import re
import shlex
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from modelpack.mount.cache import NodeCache
from modelpack.signing import generate_key
from modelpack.signing.keys import load_public_key, write_keypair

from modelpack.api.adapters import pull_with_adapters, push_adapter
from modelpack.api.transfer import push
from modelpack.cli import main
from modelpack.testdata.peft_lora import write_lora_adapter
from modelpack.testdata.synthetic import SyntheticSpec, write_checkpoint
from tests.fixtures.registry import RegistryServer
from tests.paths import REPO_ROOT

TINY = {"hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1, "num_hidden_layers": 2}
_ids = itertools.count()
#: the k8s line's modelpack image (the user's own; there is no default)
IMAGE = "registry.example.com/modelpack@sha256:" + "0" * 64


@pytest.fixture
def repo(registry: RegistryServer, request: pytest.FixtureRequest) -> str:
    return registry.ref(f"lora-args/t{next(_ids)}-{request.node.name[5:28].lower().strip('_')}", None)


def _checkpoint(tmp_path: Path, seed: int = 0) -> Path:
    ckpt = tmp_path / f"ckpt-{seed}"
    write_checkpoint(
        str(ckpt), SyntheticSpec(hidden=64, intermediate=128, vocab=128, heads=2, kv_heads=1, seed=seed)
    )
    return ckpt


def _adapter(tmp_path: Path, name: str, seed: int = 1) -> Path:
    return Path(write_lora_adapter(str(tmp_path / name), TINY, rank=4, seed=seed))


def _run(*args: str, env: dict[str, str | None] | None = None) -> Result:
    return CliRunner().invoke(main, list(args), env=env)


def test_lora_args_never_creates_a_cache(tmp_path: Path) -> None:
    """A cache directory that does not exist (named by --cache, or the default one) is an error
    naming the path, exit 1 as for every command that reads a cache; nothing is created."""
    base = "reg.example/models/llama@sha256:" + "a" * 64
    missing = tmp_path / "no-cache"
    out = _run("cache", "lora-args", base, "--cache", str(missing))
    assert out.exit_code == 1, out.output
    assert str(missing) in out.output and "Traceback" not in out.output
    assert not missing.exists()
    # the default location ($XDG_CACHE_HOME/modelpack): not created either
    xdg = tmp_path / "xdg"
    out = _run("cache", "lora-args", base, env={"XDG_CACHE_HOME": str(xdg), "MODELPACK_CACHE": None})
    assert out.exit_code == 1, out.output
    assert str(xdg / "modelpack") in out.output
    assert not (xdg / "modelpack").exists()


def _readme_recipe() -> list[str]:
    """The command lines of the README's LoRA recipe, in order."""
    text = (REPO_ROOT / "README.md").read_text()
    section = text.split("### LoRA adapters of a base model", 1)[1]
    block = re.search(r"```sh\n(.*?)```", section, re.S)
    assert block, "the README's LoRA section has no sh block"
    return [line for line in block.group(1).splitlines() if line.strip()]


def test_the_readme_lora_recipe_runs_as_written(tmp_path: Path, repo: str) -> None:
    """Every command of the README's LoRA recipe runs in order against a real registry, with only
    the registry, the digest, the adapter directory and the cache directory substituted; the
    lora-args line reads the cache the pull line filled and prints that adapter."""
    base = push(str(_checkpoint(tmp_path)), f"{repo}:base")
    write_lora_adapter(str(tmp_path / "sql-lora"), TINY, rank=4, seed=1)
    cache = tmp_path / "var-cache-modelpack"
    outputs: dict[str, str] = {}
    for line in _readme_recipe():
        line = (
            line.replace("registry.example.com/models/llama", repo)
            .replace("@sha256:…", f"@{base.digest}")
            .replace("/var/cache/modelpack", str(cache))
            .replace("./sql-lora", str(tmp_path / "sql-lora"))
        )
        argv = shlex.split(line, comments=True)
        assert argv[0] == "modelpack", line
        # no default cache anywhere but where the recipe says: a line that leans on one fails
        out = _run(
            *argv[1:],
            env={"XDG_CACHE_HOME": str(tmp_path / "xdg"), "MODELPACK_CACHE": None, "MODELPACK_IMAGE": IMAGE},
        )
        assert out.exit_code == 0, f"{line}\n{out.output}"
        outputs[argv[1] if argv[1] != "cache" else f"cache {argv[2]}"] = out.stdout
    flags = shlex.split(outputs["cache lora-args"])
    assert "--enable-lora" in flags
    (module,) = [f for f in flags if f.startswith("sql-lora=")]
    assert Path(module.split("=", 1)[1]).parent == cache / "snapshots"
    assert not (tmp_path / "xdg").exists()


def _signed_base_with_two_adapters(tmp_path: Path, repo: str) -> tuple[str, str, str, str, str]:
    """A signed base, a signed adapter and an unsigned one of it; returns (public key path,
    base digest, signed adapter digest, unsigned adapter digest, cache dir) after the policy
    pull of one job and a plain pull of the unsigned adapter by another job into one cache."""
    priv, pub = write_keypair(str(tmp_path / "ci"), generate_key())
    base = push(str(_checkpoint(tmp_path)), f"{repo}:base", sign_key=priv)
    signed = push_adapter(
        str(_adapter(tmp_path, "signed")), f"{repo}:signed", f"@{base.digest}", sign_key=priv
    )
    unsigned = push_adapter(
        str(_adapter(tmp_path, "unsigned", seed=4)), f"{repo}:unsigned", f"@{base.digest}"
    )
    cache_dir = str(tmp_path / "cache")
    cache = NodeCache(cache_dir)
    pulled = pull_with_adapters(f"{repo}@{base.digest}", cache=cache, policy=[load_public_key(pub)])
    assert [a.name for a in pulled.adapters] == ["signed"]  # the policy pull left it out
    cache.pull(f"{repo}@{unsigned.digest}")  # another job, no policy: now cached next to it
    return pub, base.digest, signed.digest, unsigned.digest, cache_dir


def _served(out: Result) -> list[str]:
    assert out.exit_code == 0, out.output
    return [a["name"] for a in json.loads(out.stdout)["adapters"]]


def test_lora_args_serves_only_adapters_that_passed_the_bases_trust(tmp_path: Path, repo: str) -> None:
    """An unsigned adapter of a base pulled under a policy, cached by another job's plain pull,
    is not handed to vLLM: not by default (the base's record on this node says which keys
    verified it; an adapter no such key verified is left out), not under --key/--policy or
    $MODELPACK_POLICY; each left-out adapter is named on stderr. Named with --adapter it fails
    the command (exit 1); an empty $MODELPACK_POLICY is refused (exit 2), never "no policy"."""
    pub, base, signed, unsigned, cache = _signed_base_with_two_adapters(tmp_path, repo)
    pinned = f"{repo}@{base}"
    # the shape of the attack: the cache holds both adapters of this base
    assert {e.digest for e in NodeCache(cache, create=False).ls()} == {base, signed, unsigned}
    policy = tmp_path / "policy.yaml"
    policy.write_text(f"default:\n  keys: [{pub}]\n  require_signature: true\n")
    for extra, env in (
        ((), {}),
        (("--key", pub), {}),
        (("--policy", str(policy)), {}),
        ((), {"MODELPACK_POLICY": str(policy)}),
        ((), {"MODELPACK_POLICY_YAML": policy.read_text()}),
    ):
        out = _run("cache", "lora-args", pinned, "--cache", cache, "--json", *extra, env=env)  # type: ignore[arg-type]
        assert _served(out) == ["signed"], (extra, env)
        assert unsigned in out.stderr and "left out" in out.stderr, (extra, env, out.stderr)
        doc = json.loads(out.stdout)
        assert unsigned.split(":")[1] not in " ".join(doc["args"])
        assert [s for s in doc["skippedAdapters"] if unsigned in s], doc
        text = _run("cache", "lora-args", pinned, "--cache", cache, *extra, env=env)  # type: ignore[arg-type]
        assert text.exit_code == 0 and "signed=" in text.stdout and unsigned.split(":")[1] not in text.stdout
    # named explicitly: the command fails, naming it
    out = _run(
        "cache", "lora-args", pinned, "--cache", cache, "--key", pub, "--adapter", f"{repo}@{unsigned}"
    )
    assert out.exit_code == 1 and unsigned in out.output and "Traceback" not in out.output, out.output
    out = _run("cache", "lora-args", pinned, "--cache", cache, "--adapter", f"{repo}@{unsigned}")
    assert out.exit_code == 1 and unsigned in out.output, out.output
    # a policy setting that rendered empty never turns the check off
    out = _run("cache", "lora-args", pinned, "--cache", cache, env={"MODELPACK_POLICY": ""})
    assert out.exit_code == 2 and "MODELPACK_POLICY" in out.output, out.output
    # a key the base was never verified with on this node: the base itself is refused
    _, other_pub = write_keypair(str(tmp_path / "other"), generate_key())
    out = _run("cache", "lora-args", pinned, "--cache", cache, "--key", other_pub)
    assert out.exit_code == 1 and base in out.output, out.output


def test_lora_args_under_a_policy_refuses_a_base_no_policy_verified(tmp_path: Path, repo: str) -> None:
    """A base and adapter cached by plain pulls carry no record of any verification: with a key
    the command fails (exit 1) naming the base; without one (nothing on this node was verified)
    every adapter of the base is listed, as before."""
    priv, pub = write_keypair(str(tmp_path / "ci"), generate_key())
    base = push(str(_checkpoint(tmp_path)), f"{repo}:base", sign_key=priv)
    ad = push_adapter(str(_adapter(tmp_path, "plain")), f"{repo}:plain", f"@{base.digest}", sign_key=priv)
    cache = str(tmp_path / "cache")
    pull_with_adapters(f"{repo}@{base.digest}", cache=NodeCache(cache))  # no policy
    out = _run("cache", "lora-args", f"{repo}@{base.digest}", "--cache", cache, "--key", pub)
    assert out.exit_code == 1 and base.digest in out.output, out.output
    out = _run("cache", "lora-args", f"{repo}@{base.digest}", "--cache", cache, "--json")
    assert _served(out) == ["plain"] and ad.digest in out.stdout
