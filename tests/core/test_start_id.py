"""One start id for every entry point.

A model start's events (the node cache's pull, the loader's reads, the compile-asset lookup) are
grouped by ``start_id`` in ``modelpack timeline``. Each entry point takes ``$MODELPACK_START_ID``
verbatim when set (the pod UID in generated manifests); when it is unset each makes a fresh id,
and every entry point makes it the same way, so ids never differ in form by where they came from.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from modelpack.cli import main
from modelpack.settings import resolve_start_id
from modelpack.testdata.synthetic import SyntheticSpec, write_checkpoint
from tests.fixtures.registry import RegistryServer

FRESH = re.compile(r"^[0-9a-f]{32}$")


def _cli(*argv: str) -> Any:
    res = CliRunner().invoke(main, [*argv, "--json"])
    assert res.exit_code == 0, f"{argv}: {res.stderr}{res.stdout}"
    return json.loads(res.stdout)


def _start_ids(events: Path) -> dict[str, set[str]]:
    """Event-name prefix (``cache``, ``loader``, ``assets``) → the start ids its events carry."""
    out: dict[str, set[str]] = {}
    for line in events.read_text().splitlines():
        e = json.loads(line)
        if "start_id" in e:
            out.setdefault(e["event"].split(".", 1)[0], set()).add(e["start_id"])
    return out


def _one_start(registry: RegistryServer, tmp_path: Path) -> tuple[dict[str, set[str]], str]:
    """A CLI pull into the node cache, a load of its snapshot and an assets pull, each logging
    to its own file; returns the start ids seen per event family and the pull's ``startId``."""
    ckpt = tmp_path / "ckpt"
    write_checkpoint(str(ckpt), SyntheticSpec(shards=1))
    ref = registry.ref("start/model", "v1")
    digest = _cli("push", str(ckpt), ref, "--progress", "off")["digest"]
    pinned = f"{ref.rsplit(':', 1)[0]}@{digest}"
    logs = [tmp_path / f"{name}.jsonl" for name in ("pull", "load", "assets")]
    pulled = _cli(
        "pull", pinned, "--cache", str(tmp_path / "cache"), "--events", str(logs[0]), "--progress", "off"
    )
    _cli("load", pulled["path"], "--expected-digest", digest, "--events", str(logs[1]), "--progress", "off")
    _cli(
        "assets",
        "pull",
        pinned,
        str(tmp_path / "ind"),
        "--kind",
        "inductor",
        "--allow-unsigned",
        "--events",
        str(logs[2]),
    )
    seen: dict[str, set[str]] = {}
    for log in logs:
        for family, ids in _start_ids(log).items():
            seen.setdefault(family, set()).update(ids)
    return seen, pulled["startId"]


def test_without_modelpack_start_id_every_entry_point_makes_an_id_of_one_form(
    registry: RegistryServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unset: the pull, the load and the assets call each make a fresh id, all 32 hex characters
    (the one maker, ``resolve_start_id``), the pull's --json naming the one its events carry."""
    monkeypatch.delenv("MODELPACK_START_ID", raising=False)
    seen, pull_id = _one_start(registry, tmp_path)
    assert {"cache", "loader", "assets"} <= set(seen), seen
    ids = set().union(*seen.values())
    assert all(FRESH.match(i) for i in ids), seen
    assert seen["cache"] == {pull_id}
    assert FRESH.match(resolve_start_id()) and resolve_start_id() != resolve_start_id()


def test_modelpack_start_id_is_taken_verbatim_by_every_entry_point(
    registry: RegistryServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Set (a pod UID): the pull, the load and the assets call all carry it unchanged."""
    uid = "5f0c2a8e-7d41-4e0b-9a37-1c2d3e4f5a6b"
    monkeypatch.setenv("MODELPACK_START_ID", uid)
    seen, pull_id = _one_start(registry, tmp_path)
    assert {"cache", "loader", "assets"} <= set(seen), seen
    assert all(ids == {uid} for ids in seen.values()), seen
    assert pull_id == uid and resolve_start_id() == uid and resolve_start_id("flag") == "flag"
