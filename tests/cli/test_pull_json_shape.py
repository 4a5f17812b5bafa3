"""``pull --json`` prints one document whether the files go to a directory or the node cache.

A script that reads a pull's outcome (what was pinned, how many files, how many bytes came over
the network, from where, how long it took, what the trust step said) reads the same keys in both
modes; what only one mode has sits under ``directory`` or ``cache``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
from click.testing import CliRunner

from modelpack.cli import main
from modelpack.cli.json_output import load_schema
from modelpack.testdata.synthetic import SyntheticSpec, write_checkpoint
from tests.fixtures.registry import RegistryServer

#: equal in both modes (``bytesDownloaded`` means the same, bytes fetched from the source, but the
#: cache also keeps the config blob, so its count is larger)
SHARED = ("reference", "digest", "files", "bytesBySource", "signature")


def _json(argv: list[str]) -> Any:
    res = CliRunner().invoke(main, [*argv, "--progress", "off", "--json"])
    assert res.exit_code == 0, f"{argv}: {res.stderr}{res.stdout}"
    return json.loads(res.stdout)


def test_directory_and_cache_pulls_print_the_same_document(registry: RegistryServer, tmp_path: Path) -> None:
    """The same model pulled into a directory and into the node cache gives documents with the
    same top-level keys, equal values for what both modes share, and the mode's own details
    under its name."""
    ckpt = tmp_path / "ckpt"
    write_checkpoint(str(ckpt), SyntheticSpec(shards=2))
    ref = registry.ref("shape/model", "v1")
    digest = _json(["push", str(ckpt), ref])["digest"]
    to_dir = _json(["pull", ref, str(tmp_path / "dest")])
    to_cache = _json(["pull", ref, "--cache", str(tmp_path / "cache")])

    assert set(to_dir) - {"directory"} == set(to_cache) - {"cache"}
    assert (to_dir["mode"], to_cache["mode"]) == ("directory", "cache")
    for key in SHARED:
        assert to_dir[key] == to_cache[key], key
    assert to_dir["digest"] == digest and to_dir["reference"] == ref
    assert to_dir["path"] == str(tmp_path / "dest")
    assert to_cache["path"].startswith(str(tmp_path / "cache"))
    assert to_dir["files"] == len(to_dir["directory"]["paths"])
    on_disk = sum(f.stat().st_size for f in (tmp_path / "dest").rglob("*") if f.is_file())
    assert to_dir["bytesDownloaded"] == on_disk  # every file fetched, nothing resumed
    assert to_cache["bytesDownloaded"] == to_cache["cache"]["bytes"]["total"] > on_disk
    assert to_cache["cache"]["state"] == "cold"
    assert {"total"} <= set(to_dir["timingsMs"]) and {"total"} <= set(to_cache["timingsMs"])
    schema = load_schema("pull")
    assert "anyOf" not in schema and "oneOf" not in schema
    for doc in (to_dir, to_cache):
        jsonschema.Draft202012Validator(schema).validate(doc)
