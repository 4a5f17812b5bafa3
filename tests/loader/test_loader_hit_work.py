"""What a cache hit does inside vLLM's ``load_model``: nothing but hand out views.

vLLM's weights phase is timed around ``load_model``, which runs the ``modelpack`` format's
``load_weights``: ``open_rank_load`` (settings, the snapshot's checks) and the rank's tensors. On a
hit every weight is a view of the mapped store blob, so the only pass over the bytes is vLLM's own
copy; anything else done there is time the default loader does not spend. One such cost was found
by profiling the hit at 1.06–1.09× the default loader on a quiet machine: ``_resolve`` imported
``modelpack.signing`` (and with it ``cryptography``'s native bindings, ~35 ms warm, more with a cold
page cache) on every start, trusted keys or not.

Each check runs in a fresh interpreter that has imported only what vLLM's plugin imports
(``modelpack.serving.weights``), so modules the test process already holds cannot hide an import.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from modelpack.errors import ModelpackError
from modelpack.serving.weights import open_rank_load
from modelpack.testdata.synthetic import SyntheticSpec, write_checkpoint
from tests.loader_helpers import pack_layout
from tests.paths import REPO_ROOT

pytestmark = pytest.mark.host_copier  # the loads run in child processes

ROOT = REPO_ROOT

CHILD = textwrap.dedent(
    """
    import json, os, sys
    import modelpack.serving.weights as w  # what vLLM's plugin has imported before load_model
    before = set(sys.modules)
    spec = json.loads(sys.argv[1])
    rank = w.open_rank_load(spec["extra"], spec["snapshot"], {}, 1, 0, environ={})
    tensors = list(rank.tensors())
    maps = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if int(parts[4]):
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                maps.append((lo, hi, int(parts[4])))
    def inode(t):
        p0, n = t.data_ptr(), t.numel() * t.element_size()
        return next((i for lo, hi, i in maps if lo <= p0 and p0 + n <= hi), None)
    s = rank.stats
    print("RESULT " + json.dumps({
        "new_modules": sorted(set(sys.modules) - before),
        "inodes": {name: inode(t) for name, t in tensors if t.numel()},
        "tensor_bytes": sum(t.numel() * t.element_size() for _, t in tensors),
        "mapped": s.mapped_bytes, "read": s.bytes_read, "staged": s.staged_bytes,
        "header": s.bytes_by_split.get("header", {}).get("read", 0),
        "verification": s.verification,
    }))
    """
)


@pytest.fixture(scope="module")
def hit(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """(snapshot directory, manifest digest) of a node-cache hit."""
    from modelpack.mount.cache import NodeCache

    base = tmp_path_factory.mktemp("hit-work")
    write_checkpoint(str(base / "ckpt"), SyntheticSpec(shards=2, seed=11))
    lay = pack_layout(base / "ckpt", base / "layout")
    return NodeCache(str(base / "cache")).pull(f"oci:{lay.path}@{lay.digest}").path, lay.digest


def _run_hit(snapshot: str, extra: dict[str, object]) -> dict[str, object]:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps({"snapshot": snapshot, "extra": extra})],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if not k.startswith("MODELPACK_")},
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            doc: dict[str, object] = json.loads(line[len("RESULT ") :])
            return doc
    raise AssertionError(f"hit child failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")


def test_a_hit_imports_no_signing_code_and_hands_vllm_only_views_of_the_blobs(hit: tuple[str, str]) -> None:
    snapshot, digest = hit
    doc = _run_hit(snapshot, {"expected_digest": digest})
    new = [m for m in doc["new_modules"] if isinstance(m, str)]  # type: ignore[union-attr]
    heavy = [m for m in new if m.startswith(("modelpack.signing", "cryptography", "_cffi_backend"))]
    assert heavy == [], f"a hit without trusted keys imported {heavy}"
    blobs = {
        os.stat(os.path.join(snapshot, n)).st_ino for n in os.listdir(snapshot) if n.endswith(".safetensors")
    }
    inodes = doc["inodes"]
    assert isinstance(inodes, dict) and inodes
    assert set(inodes.values()) <= blobs, "a tensor of the hit is not a view of a mapped store blob"
    # the only bytes read are the headers; every tensor byte is a view, nothing staged or copied
    assert doc["mapped"] == doc["tensor_bytes"]
    assert doc["read"] == doc["mapped"] + doc["header"]  # type: ignore[operator]
    assert doc["staged"] == 0
    assert set(doc["verification"].values()) == {"trusted"}  # type: ignore[union-attr]


def test_trusted_keys_on_a_hit_are_still_loaded_and_a_bad_key_refuses_the_start(
    hit: tuple[str, str], tmp_path: Path
) -> None:
    snapshot, digest = hit
    bad = tmp_path / "not-a-key.pub"
    bad.write_text("-----BEGIN PUBLIC KEY-----\nnot base64 at all\n-----END PUBLIC KEY-----\n")
    with pytest.raises(ModelpackError):
        open_rank_load(
            {"expected_digest": digest, "trusted_keys": [str(bad)]}, snapshot, {}, 1, 0, environ={}
        )


def test_a_chunk_verified_stream_loads_keys_and_chunks_not_the_policy_parser_nor_the_signer() -> None:
    """A streamed start with a chunk table imports ``modelpack.signing.chunks`` inside the timed
    ``load_model``; before, the package imported every submodule (the policy's YAML parser, the
    signer, the verifier: ~25 ms more). Names stay importable from ``modelpack.signing``."""
    probe = (
        "import sys, modelpack.signing.chunks\n"
        "print(sorted(m for m in sys.modules if m.startswith(('modelpack.signing.', 'yaml'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    loaded = set(json.loads(out.stdout.replace("'", '"')))
    assert "modelpack.signing.keys" in loaded and "modelpack.signing.chunks" in loaded
    assert not loaded & {
        "modelpack.signing.policy",
        "modelpack.signing.sign",
        "modelpack.signing.verify",
        "yaml",
    }
    from modelpack import signing

    assert signing.TrustPolicy.__module__ == "modelpack.signing.policy"
    assert signing.sign_artifact.__module__ == "modelpack.signing.sign"
    with pytest.raises(AttributeError):
        signing.no_such_name  # noqa: B018
