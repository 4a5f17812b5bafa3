"""Every ``--json`` output is a contract kept in ``modelpack/cli/schemas/``.

Each command runs against real parts (a registry, OCI layouts, a node cache, signing keys, an
adapter, a compile-cache asset) and its output validates against the JSON Schema kept for it;
every command offering ``--json`` has a schema; no key modelpack chooses is snake_case (the OCI,
Kubernetes and fingerprint documents it prints keep their own spelling), and every timestamp is
RFC 3339 UTC.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import jsonschema
import pytest
from click.testing import CliRunner

from modelpack.cli import main
from modelpack.cli.json_output import load_schema, schema_path
from modelpack.testdata.peft_lora import write_lora_adapter
from modelpack.testdata.synthetic import SyntheticSpec, write_checkpoint
from tests.fixtures.registry import RegistryServer
from tests.mount.k8s_images import IMAGE, SERVING

SNAKE = re.compile(r"^[a-z][a-z0-9]*(_[a-z0-9]+)+$")
RFC3339_UTC = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d{1,9})?Z$")
#: keys that hold a time wherever they appear in an output
TIME_KEYS = re.compile(r"^(created|until|lastUsed|[a-z]+At)$")


def _json_commands() -> list[str]:
    """Every command (space-separated path) that offers ``--json``, walked from the click tree."""
    found: list[str] = []

    def walk(cmd: click.Command, path: list[str], ctx: click.Context) -> None:
        if isinstance(cmd, click.Group):
            for name in cmd.list_commands(ctx):
                sub = cmd.get_command(ctx, name)
                assert sub is not None, name
                walk(sub, [*path, name], click.Context(sub, info_name=name, parent=ctx))
        elif any(isinstance(p, click.Option) and "--json" in p.opts for p in cmd.params):
            found.append(" ".join(path))

    walk(main, [], click.Context(main, info_name="modelpack"))
    return sorted(found)


COMMANDS = _json_commands()


def _invoke(argv: list[str]) -> Any:
    res = CliRunner().invoke(main, argv)
    assert res.exit_code == 0, f"{argv}: {res.stderr}{res.stdout}"
    return json.loads(res.stdout)


@pytest.fixture(scope="module")
def outputs(
    registry: RegistryServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, list[Any]]]:
    """Each command → its parsed ``--json`` outputs, every command run in a plausible order."""
    tmp = tmp_path_factory.mktemp("json-outputs")
    out: dict[str, list[Any]] = {}

    def run(command: str, *argv: str) -> Any:
        doc = _invoke([*command.split(), *argv, "--json"])
        out.setdefault(command, []).append(doc)
        return doc

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MODELPACK_UPLOAD_STATE_DIR", str(tmp / "upload-state"))
        mp.setenv("DOCKER_CONFIG", str(tmp / "docker"))
        mp.setenv("MODELPACK_IMAGE", IMAGE)  # the k8s objects' modelpack image (no default)
        ckpt, other = tmp / "ckpt", tmp / "ckpt2"
        write_checkpoint(str(ckpt), SyntheticSpec(shards=2))
        write_checkpoint(str(other), SyntheticSpec(shards=2, seed=3))  # same files, other tensors
        cache, events = str(tmp / "cache"), tmp / "events.jsonl"
        layout = f"oci:{tmp / 'layout'}"
        repo = registry.ref("json/model", None)
        quiet = ("--progress", "off")

        keys = run("keygen", "--out", str(tmp / "keys" / "ci"))
        key, pub = keys["privateKey"], keys["publicKey"]
        run("pack", str(ckpt), f"{layout}:v1")
        run("pack", str(other), f"{layout}:v2")
        digest = run("push", str(ckpt), f"{repo}:v1", *quiet)["digest"]
        pinned = f"{repo}@{digest}"
        run("push", str(other), f"{repo}:v2", "--sign-key", key, *quiet)
        run("tag", f"{repo}:v1", "stable")
        run("cp", f"{repo}:v1", f"{layout}:copy", *quiet)
        run("sign", pinned, "--key", key)
        run("verify", pinned, "--key", pub)
        run("verify", f"{repo}:v2", "--key", pub, "--directory", str(other))
        run("ls", repo)
        run("ls", layout)
        run("inspect", f"{repo}:v1")
        run("diff", f"{layout}:v1", f"{layout}:v2")
        run("audit", repo, "--key", pub)
        run("pull", pinned, str(tmp / "dest"), *quiet)
        snapshot = run("pull", pinned, "--cache", cache, "--events", str(events), "--hold", "1h", *quiet)[
            "path"
        ]
        run("cache ls", "--cache", cache)
        run("cache verify", "--cache", cache)
        run("load", snapshot, "--expected-digest", digest)
        run("timeline", str(events))
        tiny = {
            "hidden_size": 256,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "num_hidden_layers": 2,
        }
        adapter = write_lora_adapter(str(tmp / "sql-lora"), tiny, rank=4, seed=1)
        run("push", adapter, f"{repo}:sql", "--base", pinned, *quiet)
        run("pull", pinned, "--cache", cache, "--with-adapters", *quiet)
        run("cache lora-args", pinned, "--cache", cache)
        run("index create", f"{repo}:idx", f"{repo}:v1", f"{repo}:v2", "--variant", "2:precision=f32")
        run("index show", f"{repo}:idx")
        run("index show", f"{repo}:idx", "--variant", "precision=f32")
        run("pull", f"{repo}:idx", "--cache", cache, "--variant", "precision=f32", *quiet)
        run("pull", f"{repo}:idx", str(tmp / "dest-f32"), "--variant", "precision=f32", *quiet)
        run("cache gc", "--cache", cache, "--max-bytes", "1", "--min-age", "0")
        compiled = tmp / "inductor"
        (compiled / "fxgraph").mkdir(parents=True)
        (compiled / "fxgraph" / "entry").write_bytes(b"compiled")
        run("assets fingerprint", pinned)
        run("assets push", pinned, str(compiled), "--kind", "inductor", "--sign-key", key)
        run("assets ls", pinned)
        run("assets pull", pinned, str(tmp / "ind"), "--kind", "inductor", "--key", pub)
        run("k8s pod", "--image-volume", pinned, "--image", SERVING)
        run("k8s init-container", pinned, "--image", SERVING)
        run("k8s prewarm", pinned, "--node-selector", "pool=gpu")
        run("k8s kserve inferenceservice", pinned, "--name", "m", "--image", SERVING)
        run(
            "k8s kserve localmodelcache",
            pinned,
            *("--name", "m", "--node-group", "gpu", "--model-size", "1Gi", "--node-selector", "pool=gpu"),
        )
        run("k8s kserve storage-containers")
    yield out


def _property_names(schema: Any, where: str) -> Iterator[tuple[str, str]]:
    """(where, name) of every property a schema declares, outside documents (``x-document``)."""
    if isinstance(schema, dict):
        if schema.get("x-document"):
            return
        for name, sub in (schema.get("properties") or {}).items():
            yield where, name
            yield from _property_names(sub, f"{where}.{name}")
        for key, sub in schema.items():
            if key != "properties":
                yield from _property_names(sub, f"{where}/{key}")
    elif isinstance(schema, list):
        for i, sub in enumerate(schema):
            yield from _property_names(sub, f"{where}[{i}]")


def _times(doc: Any, where: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(doc, dict):
        for key, value in doc.items():
            if TIME_KEYS.match(key):
                yield f"{where}.{key}", value
            yield from _times(value, f"{where}.{key}")
    elif isinstance(doc, list):
        for item in doc:
            yield from _times(item, f"{where}[]")


def test_every_command_offering_json_has_a_schema() -> None:
    """A command gains ``--json`` only with a schema for what it prints, and a schema without a
    command is removed with it."""
    assert len(COMMANDS) > 25
    for command in COMMANDS:
        schema = load_schema(command)
        jsonschema.Draft202012Validator.check_schema(schema)
        assert schema["$id"].endswith(schema_path(command).name), command
    shipped = {p.name for p in schema_path(COMMANDS[0]).parent.glob("*.json")}
    assert shipped == {schema_path(c).name for c in COMMANDS}


@pytest.mark.parametrize("command", COMMANDS)
def test_json_output_validates_against_its_schema(outputs: dict[str, list[Any]], command: str) -> None:
    """What the command prints with ``--json`` against real fixtures is what its schema says."""
    samples = outputs.get(command)
    assert samples, f"{command}: no case runs it with --json"
    validator = jsonschema.Draft202012Validator(
        load_schema(command), format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
    )
    for doc in samples:
        errors = sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path))
        assert not errors, "\n".join(f"{list(e.absolute_path)}: {e.message}" for e in errors[:10])


def test_no_key_modelpack_chooses_is_snake_case() -> None:
    """Every ``--json`` key modelpack names is camelCase, as in the OCI and Kubernetes documents
    it prints; the schemas forbid undeclared keys, so the outputs cannot carry others."""
    bad = [
        f"{command}: {where}.{name}"
        for command in COMMANDS
        for where, name in _property_names(load_schema(command), "")
        if SNAKE.match(name) or "-" in name
    ]
    assert not bad, bad


def test_every_timestamp_is_rfc3339_utc(outputs: dict[str, list[Any]]) -> None:
    """``created``, ``lastUsed``, ``until`` and every ``…At`` are RFC 3339 UTC strings (or null
    when never recorded), never epoch numbers."""
    seen = 0
    for command, samples in outputs.items():
        for doc in samples:
            for where, value in _times(doc):
                seen += value is not None
                assert value is None or (isinstance(value, str) and RFC3339_UTC.match(value)), (
                    f"{command}: {where} = {value!r}"
                )
    assert seen >= 5  # cache ls, pull --hold, verify, assets ls …: the check saw real times


def test_schemas_ship_in_the_package() -> None:
    """The schemas are package data (``modelpack/cli/schemas``), so an installed wheel has them."""
    import modelpack.cli

    folder = Path(modelpack.cli.__file__).parent / "schemas"
    assert schema_path("pull").parent == folder and (folder / "pull.json").is_file()
