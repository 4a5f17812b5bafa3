"""A tag moved from signed v2 back to signed v1 is a rollback, and is refused.

Each test starts from the attack: a real registry, a key that signed two versions of a model
under one tag, and someone with push access who points the tag back at the older manifest (an
HTTP ``PUT`` of its bytes under the tag, as any registry client does). The node cache has
accepted v2 for the tag; the next ``pull TAG --cache --key`` (a real ``modelpack`` process) must
refuse v1, naming both digests and signing times, on a hit and on a miss; ``--allow-rollback``
accepts it. Untimed signatures count as time 0. A record another uid forged or removed (its
directory left writable) does not lower the bar. ``audit --cache`` shows the history.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from modelpack.mount import NodeCache
from modelpack.mount.rollback import TagHistory
from modelpack.mount.snapshots import remove_tree
from modelpack.signing.bundle import Bundle, sign_statement
from modelpack.signing.keys import load_private_key
from modelpack.signing.referrers import ARTIFACT_TYPE_SIGNATURE, push_bundle_referrer
from modelpack.signing.signing_time import ANNOTATION_SIGNED_AT, parse_signing_time
from modelpack.signing.statements import PREDICATE_COSIGN_SIGN, manifest_statement

from modelpack.oci.reference import parse_reference
from modelpack.targets.opener import open_target
from modelpack.testdata.synthetic import SyntheticSpec, write_checkpoint

pytestmark = pytest.mark.timeout(300)

MODELPACK = str(Path(sys.executable).with_name("modelpack"))
NOBODY = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
PY = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable  # stdlib only
MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "MODELPACK_LOCK_TIMEOUT": "10"}
    return subprocess.run(
        [MODELPACK, *args], capture_output=True, text=True, timeout=240, env=env, check=False
    )


def ok(*args: str) -> subprocess.CompletedProcess[str]:
    res = cli(*args)
    assert res.returncode == 0, f"{args}: {res.stderr[-3000:]}"
    return res


@pytest.fixture
def shared_root() -> Iterator[Path]:
    """A directory every uid can traverse (pytest's tmp_path is root-only), for the cache."""
    base = tempfile.mkdtemp(prefix="mp-rollback-", dir="/tmp")
    os.chmod(base, 0o755)
    try:
        yield Path(base)
    finally:
        remove_tree(base)


class Published:
    """Two signed versions of one model under one tag in a real registry."""

    def __init__(self, registry: Any, tmp_path: Path, repo: str) -> None:
        self.registry = registry
        self.repo = repo
        self.ref = registry.ref(repo, "prod")
        keys = tmp_path / "keys"
        ok("keygen", "--out", str(keys / "ci"))
        self.key, self.pub = str(keys / "ci.key"), str(keys / "ci.pub")
        self.digests: dict[str, str] = {}
        for seed, version in ((1, "v1"), (2, "v2")):
            ck = tmp_path / f"ck-{version}"
            write_checkpoint(str(ck), SyntheticSpec(seed=seed))
            ok("push", str(ck), self.ref, "--sign-key", self.key)  # push + sign, the tag moves to it
            self.digests[version] = self.resolve()

    def resolve(self) -> str:
        r = requests.head(
            f"http://{self.registry.host}/v2/{self.repo}/manifests/prod",
            headers={"Accept": MANIFEST_TYPE},
            timeout=30,
        )
        r.raise_for_status()
        return str(r.headers["Docker-Content-Digest"])

    def retag(self, version: str) -> None:
        """What anyone with push access can do: PUT an older manifest's bytes under the tag."""
        base = f"http://{self.registry.host}/v2/{self.repo}/manifests"
        raw = requests.get(f"{base}/{self.digests[version]}", headers={"Accept": MANIFEST_TYPE}, timeout=30)
        raw.raise_for_status()
        put = requests.put(
            f"{base}/prod", data=raw.content, headers={"Content-Type": MANIFEST_TYPE}, timeout=30
        )
        assert put.status_code == 201, put.text
        assert self.resolve() == self.digests[version]

    def signed_at(self, version: str) -> str:
        """The signing time inside v's signed statement, read back by `verify --json`."""
        doc = json.loads(
            ok(
                "verify",
                f"{self.registry.ref(self.repo, None)}@{self.digests[version]}",
                "--key",
                self.pub,
                "--json",
            ).stdout
        )
        assert doc["status"] == "verified"
        return str(doc["signedAt"])

    def pull(self, cache: Path, *extra: str) -> subprocess.CompletedProcess[str]:
        return cli("pull", self.ref, "--cache", str(cache), "--key", self.pub, "--json", *extra)


@pytest.fixture
def published(registry: Any, tmp_path: Path, request: pytest.FixtureRequest) -> Published:
    name = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower().removeprefix("test_"))[:48].strip("-")
    return Published(registry, tmp_path, f"rollback/{name}")


def _state(res: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert res.returncode == 0, res.stderr[-3000:]
    doc: dict[str, Any] = json.loads(res.stdout)
    return doc


def test_the_signing_time_is_inside_the_signed_statement(published: Published) -> None:
    """The time sits in the in-toto subject's annotations of the DSSE payload the key signed;
    cosign's predicate stays empty; v2 was signed after v1."""
    target = open_target(parse_reference(published.ref), for_write=False)
    desc = target.resolve(published.digests["v2"])
    from modelpack.signing.referrers import find_bundle_referrers

    (item,) = find_bundle_referrers(target, desc, ARTIFACT_TYPE_SIGNATURE)
    assert item.bundle is not None
    doc = json.loads(item.bundle.to_bytes())
    statement = json.loads(base64.b64decode(doc["dsseEnvelope"]["payload"]))
    assert statement["predicate"] == {} and statement["predicateType"] == PREDICATE_COSIGN_SIGN
    (subject,) = statement["subject"]
    assert subject["digest"] == {"sha256": published.digests["v2"][7:]}
    assert set(subject["annotations"]) == {ANNOTATION_SIGNED_AT}
    assert subject["annotations"][ANNOTATION_SIGNED_AT] == published.signed_at("v2")
    assert parse_signing_time(published.signed_at("v1")) < parse_signing_time(published.signed_at("v2"))


@pytest.mark.parametrize("cached", ["hit", "miss"])
def test_a_tag_moved_back_to_an_older_signed_version_is_refused(
    cached: str, published: Published, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    if cached == "hit":  # v1 is in the cache already: the rollback would be a hit
        ok(
            "pull",
            f"{published.registry.ref(published.repo, None)}@{published.digests['v1']}",
            "--cache",
            str(cache),
            "--key",
            published.pub,
        )
    accepted = _state(published.pull(cache))
    assert accepted["digest"] == published.digests["v2"]
    assert _state(published.pull(cache))["cache"]["state"] == "hit"  # the same version again: fine
    published.retag("v1")

    refused = published.pull(cache)
    assert refused.returncode == 1, refused.stdout
    err = refused.stderr
    assert "rollback" in err and "--allow-rollback" in err, err
    for v in ("v1", "v2"):  # both digests and both signing times are named
        assert published.digests[v] in err and published.signed_at(v) in err, err
    assert "Traceback" not in err
    events = [json.loads(line) for line in (cache / "events.jsonl").read_text().splitlines()]
    (ev,) = [e for e in events if e["event"] == "cache.rollback_refused"]
    assert ev["digest"] == published.digests["v1"] and ev["newest_digest"] == published.digests["v2"]
    # the refused version did not become the tag's local name (open_snapshot/load by tag)
    path = ok("cache", "path", published.ref, "--cache", str(cache)).stdout.strip()
    assert path.endswith(published.digests["v2"][7:])

    allowed = _state(published.pull(cache, "--allow-rollback"))
    assert allowed["digest"] == published.digests["v1"]
    # accepted explicitly: v1 is the tag's newest now, so the next pull needs no flag
    assert _state(published.pull(cache))["digest"] == published.digests["v1"]
    published.retag("v2")
    assert _state(published.pull(cache))["digest"] == published.digests["v2"]


def test_allow_rollback_needs_the_node_cache(published: Published, tmp_path: Path) -> None:
    res = cli("pull", published.ref, str(tmp_path / "dir"), "--key", published.pub, "--allow-rollback")
    assert res.returncode == 2 and "--cache" in res.stderr, res.stderr


def test_an_untimed_signature_counts_as_time_zero(published: Published, tmp_path: Path) -> None:
    """A version signed without a time (an older modelpack, another signer): accepted while the
    tag has no timed history, refused once a timed version was accepted for the tag."""
    registry = published.registry
    ck = tmp_path / "ck-v0"
    write_checkpoint(str(ck), SyntheticSpec(seed=3))
    old_ref = registry.ref(published.repo, "old")
    ok("push", str(ck), old_ref)  # unsigned; then signed by the same key, without a time
    target = open_target(parse_reference(old_ref), for_write=True)
    desc = target.resolve("old")
    key = load_private_key(published.key)
    untimed = sign_statement(manifest_statement(desc.digest.hex), key)
    assert ANNOTATION_SIGNED_AT not in untimed.envelope.payload.decode()
    push_bundle_referrer(
        target, desc, untimed, artifact_type=ARTIFACT_TYPE_SIGNATURE, predicate_type=PREDICATE_COSIGN_SIGN
    )
    published.digests["v0"] = str(desc.digest)
    first = tmp_path / "first"
    published.retag("v0")
    assert _state(published.pull(first))["digest"] == published.digests["v0"]  # nothing newer known
    published.retag("v2")
    assert _state(published.pull(first))["digest"] == published.digests["v2"]
    published.retag("v0")
    refused = published.pull(first)
    assert refused.returncode == 1 and "no signing time (counts as 0)" in refused.stderr, refused.stderr


def test_a_malformed_signing_time_is_not_a_valid_signature(published: Published, tmp_path: Path) -> None:
    target = open_target(parse_reference(published.ref), for_write=True)
    desc = target.resolve(published.digests["v2"])
    statement = manifest_statement(desc.digest.hex)
    subject = dict(statement.subjects[0], annotations={ANNOTATION_SIGNED_AT: "yesterday"})
    bad = type(statement)((subject,), statement.predicate_type, statement.predicate)
    bundle: Bundle = sign_statement(bad, load_private_key(published.key))
    push_bundle_referrer(
        target, desc, bundle, artifact_type=ARTIFACT_TYPE_SIGNATURE, predicate_type=PREDICATE_COSIGN_SIGN
    )
    doc = json.loads(ok("verify", published.ref, "--key", published.pub, "--json").stdout)
    statuses = sorted(s["status"] for s in doc["signatures"])
    assert statuses == ["invalid", "verified"], doc  # the good one still verifies; its time counts
    (invalid,) = [s for s in doc["signatures"] if s["status"] == "invalid"]
    assert "RFC 3339" in invalid["reason"]
    assert doc["signedAt"] == published.signed_at("v2")


FORGE = """
import json, os, sys
path, doc = sys.argv[1], sys.argv[2]
if doc == "-":
    os.unlink(path)
else:
    with open(path + ".x", "w") as f:
        f.write(doc)
    os.rename(path + ".x", path)
print("done")
"""


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv")
@pytest.mark.parametrize("forgery", ["lower-bar", "delete"])
def test_a_record_forged_by_another_uid_does_not_lower_the_bar(
    forgery: str, published: Published, shared_root: Path
) -> None:
    cache = shared_root / "cache"
    assert _state(published.pull(cache))["digest"] == published.digests["v2"]
    history = TagHistory(str(cache), os.geteuid())
    record_path = history.path(parse_reference(published.ref).canonical_name, "prod")
    honest = json.loads(Path(record_path).read_text())
    assert honest["newest"]["digest"] == published.digests["v2"]
    assert stat.S_IMODE(os.stat(record_path).st_mode) == 0o644
    assert stat.S_IMODE(os.stat(history.dir).st_mode) == 0o755
    # the directory was left writable (an older version, a careless chmod): nobody rewrites the
    # record so that v1 is the newest, or removes it so that nothing is known
    os.chmod(cache, 0o755)  # a cache other uids may read (the default root is 0750)
    os.chmod(history.dir, 0o777)
    forged = dict(honest, newest=dict(honest["newest"], digest=published.digests["v1"], signedAt=""))
    out = subprocess.run(
        [*NOBODY, PY, "-c", FORGE, record_path, "-" if forgery == "delete" else json.dumps(forged)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert out.stdout.strip() == "done", out
    published.retag("v1")
    refused = published.pull(cache)
    assert refused.returncode == 1, refused.stdout
    assert "cannot be trusted" in refused.stderr and "--allow-rollback" in refused.stderr, refused.stderr
    # the operator looks, then re-establishes the history explicitly
    accepted = _state(published.pull(cache, "--allow-rollback"))
    assert accepted["digest"] == published.digests["v1"]
    st = os.stat(record_path)
    assert st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o644
    assert stat.S_IMODE(os.stat(history.dir).st_mode) == 0o755
    assert json.loads(Path(record_path).read_text())["newest"]["digest"] == published.digests["v1"]


def test_a_malformed_or_oversized_record_refuses(published: Published, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    assert _state(published.pull(cache))["digest"] == published.digests["v2"]
    record_path = Path(
        TagHistory(str(cache), os.geteuid()).path(parse_reference(published.ref).canonical_name, "prod")
    )
    for damage in (b"{" * 100, b" " * (64 * 1024 + 1), b'{"version": 1}'):
        record_path.write_bytes(damage)
        os.chmod(record_path, 0o644)
        res = published.pull(cache)
        assert res.returncode == 1 and "cannot be trusted" in res.stderr, res.stderr


def test_audit_shows_the_tag_history(published: Published, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    repo = published.registry.ref(published.repo, None)
    published.retag("v1")
    _state(published.pull(cache))
    published.retag("v2")
    _state(published.pull(cache))
    published.retag("v1")  # the registry now names the older one
    res = cli("audit", repo, "--key", published.pub, "--cache", str(cache), "--json")
    assert res.returncode == 1, res.stderr  # a rollback is reported like a moved tag: exit 1
    (doc,) = json.loads(res.stdout)["repositories"]
    signed = {v["digest"]: v["signature"]["signedAt"] for v in doc["versions"]}
    assert signed[published.digests["v1"]] == published.signed_at("v1")
    (hist,) = doc["tagHistory"]
    assert hist["tag"] == "prod"
    assert [h["digest"] for h in hist["history"]] == [published.digests["v1"], published.digests["v2"]]
    assert hist["newest"]["digest"] == published.digests["v2"]
    assert hist["rollback"] is True and hist["current"] == published.digests["v1"]
    table = cli("audit", repo, "--key", published.pub, "--cache", str(cache))
    assert table.returncode == 1
    assert f"ROLLBACK {doc['repository']}:prod" in table.stdout, table.stdout
    assert published.signed_at("v2") in table.stdout
    # without a cache: what the registry's signatures say, per version
    res = cli("audit", repo, "--key", published.pub, "--json")
    assert res.returncode == 0
    (doc,) = json.loads(res.stdout)["repositories"]
    assert {v["digest"]: v["signature"]["signedAt"] for v in doc["versions"]}[published.digests["v1"]] == (
        published.signed_at("v1")
    )


def test_library_decisions(tmp_path: Path, registry: Any) -> None:
    """``TagHistory`` on its own: equal times pass, older ones are refused with a reason, a
    digest-pinned reference is no tag pull, and writes happen only when the bar moves."""
    cache = NodeCache(str(tmp_path / "c"))
    ref = parse_reference(registry.ref("rollback/lib", "prod"))
    d1, d2 = "sha256:" + "1" * 64, "sha256:" + "2" * 64
    assert cache.tags.decide(ref, d1, 100.0).allowed
    cache.tags.accept(ref, d2, 200.0)
    mtime = os.stat(cache.tags.path(ref.canonical_name, "prod")).st_mtime_ns
    cache.tags.accept(ref, d2, 200.0)
    assert os.stat(cache.tags.path(ref.canonical_name, "prod")).st_mtime_ns == mtime
    assert cache.tags.decide(ref, d1, 200.0).allowed
    no = cache.tags.decide(ref, d1, 199.0)
    assert not no.allowed and d1 in no.reason and d2 in no.reason
    assert cache.tags.read(ref.with_digest(d1)) is None
    # two pulls racing: v1's check passed before v2 was accepted, v1 is recorded after it — the
    # bar stays at v2 (it only moves forward), v1 joins the history
    d3 = "sha256:" + "3" * 64
    cache.tags.accept(ref, d3, 300.0)
    cache.tags.accept(ref, d1, 250.0)
    record = cache.tags.read(ref)
    assert record is not None and record.newest.digest == d3
    assert [v.digest for v in record.history] == [d2, d3, d1]
    cache.tags.accept(ref, d1, 250.0, rollback=True)  # --allow-rollback does move it back
    record = cache.tags.read(ref)
    assert record is not None and record.newest.digest == d1 and record.newest.rollback
    # another spelling of the same registry is the same tag
    other = parse_reference(registry.ref("rollback/lib", "prod").replace("127.0.0.1", "127.000.000.001"))
    assert not cache.tags.decide(other, d1, 0.0).allowed
