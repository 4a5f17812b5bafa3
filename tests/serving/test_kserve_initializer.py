"""``modelpack storage-initializer`` run the way KServe runs it.

Each test starts a real registry with htpasswd auth (TLS with a private CA where it says so),
pushes a generated model, and runs the CLI as KServe's webhook and LocalModelNode agent start
the ClusterStorageContainer: KServe's argv pairs, its environment, uid 1000, a read-only root
filesystem with the pod's volumes writable (``tests/kserve_support.py``). Requests are counted
in the registry's access log.
"""

from __future__ import annotations

import hashlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from modelpack.signing import generate_key
from modelpack.signing.keys import write_keypair

from modelpack import api
from modelpack.events import read_events
from modelpack.oci.descriptor import Manifest
from modelpack.targets.opener import TargetOptions, open_readable
from modelpack.testdata.synthetic import SyntheticSpec, write_checkpoint
from tests.fixtures.faultproxy import FaultProxy
from tests.kserve_support import (
    Pod,
    blob_gets,
    kserve_env,
    pod_volumes,
    run_initializer,
    start_initializer,
    write_docker_config,
)
from tests.mount.k8s_images import IMAGE

pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: setpriv to uid 1000 and a mount namespace"),
]


@pytest.fixture
def pod() -> Iterator[Pod]:
    yield from pod_volumes()


def _options(registry, *, plain: bool = False) -> TargetOptions:  # type: ignore[no-untyped-def]
    return TargetOptions(
        plain_http=plain,
        ca_file=str(registry.ca_file) if registry.ca_file else None,
        username=registry.username,
        password=registry.password,
        credentials_host=registry.host,
    )


def _push(registry, tmp_path: Path, repo: str, *, seed: int, plain: bool = False, **spec) -> str:  # type: ignore[no-untyped-def]
    ckpt = tmp_path / f"ckpt-{repo.replace('/', '-')}-{seed}"
    write_checkpoint(str(ckpt), SyntheticSpec(seed=seed, **spec))
    return api.push(
        str(ckpt), registry.ref(repo, "v1"), target_options=_options(registry, plain=plain)
    ).digest


def _manifest(registry, repo: str, digest: str, *, plain: bool = False) -> Manifest:  # type: ignore[no-untyped-def]
    target = open_readable(f"{registry.host}/{repo}@{digest}", _options(registry, plain=plain))
    raw, _ = target.fetch_manifest(digest)
    return Manifest.parse(raw)


def _expected_files(manifest: Manifest) -> dict[str, str]:
    from modelpack.mediatypes.annotations import layer_filepath

    return {layer_filepath(layer.annotations) or "": str(layer.digest) for layer in manifest.layers}


def _sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _tls_pod(pod: Pod, registry) -> None:  # type: ignore[no-untyped-def]
    ca = pod.ca_dir / "cabundle.crt"
    ca.write_bytes(Path(registry.ca_file).read_bytes())
    os.chmod(ca, 0o444)
    write_docker_config(pod, registry.host, registry.username, registry.password)


def test_two_pairs_tls_basic_auth_through_the_node_cache_then_a_rerun_fetches_no_blob(
    registry_factory, pod: Pod, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    registry = registry_factory.start(basic_auth=True, tls=True)
    d1 = _push(registry, tmp_path, "kserve/llama", seed=1, shards=2)
    d2 = _push(registry, tmp_path, "kserve/lora", seed=2, shards=1)
    _tls_pod(pod, registry)
    env = kserve_env(pod, MODELPACK_CACHE=str(pod.node_cache), MODELPACK_PROGRESS_INTERVAL="0.2")
    a, b = pod.dest("models/llama"), pod.dest("models/lora")
    args = [
        f"modelpack://{registry.ref('kserve/llama', 'v1')}",
        str(a),
        f"modelpack://{registry.host}/kserve/lora@{d2}",
        str(b),
    ]

    first = run_initializer(pod, args, env)
    assert first.returncode == 0, first.stderr
    assert first.stderr == ""  # progress and summaries are stdout lines, the error channel is empty
    assert "[1/2]" in first.stdout and "[2/2]" in first.stdout and "\r" not in first.stdout
    for dest, repo, digest in ((a, "kserve/llama", d1), (b, "kserve/lora", d2)):
        expected = _expected_files(_manifest(registry, repo, digest))
        got = pod.files(dest)
        assert set(got) == set(expected)
        assert all(_sha(data) == expected[name] for name, data in got.items())
        assert all(p.stat().st_uid == 1000 for p in dest.rglob("*"))
    assert registry.password not in first.stdout + first.stderr

    mark = registry.log_mark()
    again = run_initializer(pod, args, env)
    assert again.returncode == 0, again.stderr
    assert blob_gets(registry, mark) == {}  # complete DEST, cached model: no blob request at all
    ready = [e for e in read_events(str(pod.node_cache / "events.jsonl")) if e["event"] == "kserve.ready"]
    assert [e["state"] for e in ready] == ["cold", "cold", "hit", "hit"]
    assert ready[-1]["placed"]["present"] == ready[-1]["files"]


def test_without_a_cache_each_file_is_verified_into_dest_and_a_rerun_fetches_no_blob(
    registry_factory, pod: Pod, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    registry = registry_factory.start(basic_auth=True, tls=True)
    digest = _push(registry, tmp_path, "kserve/direct", seed=3, shards=2)
    _tls_pod(pod, registry)
    env = kserve_env(pod)
    dest = pod.dest("models")
    args = [f"modelpack://{registry.host}/kserve/direct@{digest}", str(dest)]
    first = run_initializer(pod, args, env)
    assert first.returncode == 0, first.stderr
    expected = _expected_files(_manifest(registry, "kserve/direct", digest))
    assert {n: _sha(d) for n, d in pod.files(dest).items()} == expected
    mark = registry.log_mark()
    assert run_initializer(pod, args, env).returncode == 0
    assert blob_gets(registry, mark) == {}


def test_a_corrupted_blob_in_the_registry_exits_non_zero_and_leaves_no_unverified_file(
    registry_factory, pod: Pod, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    registry = registry_factory.start(basic_auth=True, tls=True)
    digest = _push(registry, tmp_path, "kserve/corrupt", seed=4, shards=2)
    manifest = _manifest(registry, "kserve/corrupt", digest)
    weights = max(manifest.layers, key=lambda layer: layer.size)
    data = registry.blob_data_path(str(weights.digest))
    blob = bytearray(data.read_bytes())
    blob[len(blob) // 2] ^= 0x01
    data.write_bytes(bytes(blob))
    _tls_pod(pod, registry)
    expected = _expected_files(manifest)
    uri = f"modelpack://{registry.host}/kserve/corrupt@{digest}"
    for cached in (False, True):
        dest = pod.dest("cached" if cached else "direct")
        env = kserve_env(pod, MODELPACK_CACHE=str(pod.node_cache) if cached else None)
        run = run_initializer(pod, [uri, str(dest)], env)
        assert run.returncode != 0
        lines = run.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and str(weights.digest) in lines[0]
        # at a final name, only files that match their layer digest; a sibling blob cancelled by
        # the failure may keep a hidden ``.tmp-….partial`` (no loader globs it) that the init
        # container's restart resumes; nothing else that is temporary stays
        finals = {n: c for n, c in pod.files(dest).items() if not Path(n).name.startswith(".tmp-")}
        for name, content in finals.items():
            assert _sha(content) == expected[name], name
        assert all(p.suffix == ".partial" for p in dest.rglob(".tmp-*")), sorted(dest.rglob(".tmp-*"))
        assert not (dest / weights.annotations["org.opencontainers.image.title"]).exists()
    refused = [e for e in read_events(str(pod.node_cache / "events.jsonl")) if e["event"] == "kserve.refused"]
    assert refused and refused[-1]["error"] == "DigestMismatchError"

    # the registry is mended; the init container's restart completes into the same DEST and
    # leaves no partial behind
    blob[len(blob) // 2] ^= 0x01
    data.write_bytes(bytes(blob))
    for cached in (False, True):
        dest = pod.dest("cached" if cached else "direct")
        env = kserve_env(pod, MODELPACK_CACHE=str(pod.node_cache) if cached else None)
        run = run_initializer(pod, [uri, str(dest)], env)
        assert run.returncode == 0, run.stderr
        assert {n: _sha(c) for n, c in pod.files(dest).items()} == expected


def test_a_policy_with_another_key_is_refused_with_one_line_and_an_event(
    registry_factory, pod: Pod, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    registry = registry_factory.start(basic_auth=True, tls=True)
    ckpt = tmp_path / "signed"
    write_checkpoint(str(ckpt), SyntheticSpec(seed=5, shards=1))
    signer = generate_key()
    digest = api.push(
        str(ckpt), registry.ref("kserve/signed", "v1"), target_options=_options(registry), sign_key=signer
    ).digest
    _, signer_pub = write_keypair(str(tmp_path / "signer"), signer)
    _, other_pub = write_keypair(str(tmp_path / "other"), generate_key())
    _tls_pod(pod, registry)
    policies = pod.root / "policy"
    policies.mkdir()
    for name, pub in (("other", other_pub), ("signer", signer_pub)):
        (policies / f"{name}.pub").write_bytes(Path(pub).read_bytes())
        (policies / f"{name}.yaml").write_text(
            f"rules:\n  - match: '{registry.host}/kserve/*'\n    keys: [{{path: {name}.pub}}]\n    require_signature: true\n"
        )
    os.chmod(policies, 0o755)
    uri = f"modelpack://{registry.ref('kserve/signed', 'v1')}"
    for cached in (False, True):
        dest = pod.dest("cached" if cached else "direct")
        events = pod.tmp / f"events-{cached}.jsonl"
        env = kserve_env(
            pod,
            MODELPACK_POLICY=str(policies / "other.yaml"),
            MODELPACK_EVENTS=str(events),
            MODELPACK_CACHE=str(pod.node_cache) if cached else None,
        )
        refused = run_initializer(pod, [uri, str(dest)], env)
        assert refused.returncode == 1
        assert len(refused.stderr.splitlines()) == 1 and refused.stderr.startswith("error: ")
        assert not dest.exists() or pod.files(dest) == {}
        names = [e["event"] for e in read_events(str(events))]
        assert "kserve.refused" in names
        env["MODELPACK_POLICY"] = str(policies / "signer.yaml")
        accepted = run_initializer(pod, [uri, str(dest)], env)
        assert accepted.returncode == 0, accepted.stderr
        assert pod.files(dest) and digest in accepted.stdout


def test_kill_9_mid_download_then_the_rerun_fetches_only_the_missing_bytes(
    registry_factory, pod: Pod, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    registry = registry_factory.start(basic_auth=True)
    digest = _push(registry, tmp_path, "kserve/kill", seed=6, plain=True, shards=2, layers=4)
    proxy = FaultProxy(registry.host, rate=512 * 1024)
    try:
        write_docker_config(pod, proxy.host, registry.username, registry.password)
        env = kserve_env(
            pod,
            MODELPACK_CACHE=str(pod.node_cache),
            MODELPACK_PLAIN_HTTP="true",
            MODELPACK_PROGRESS_INTERVAL="0.2",
        )
        dest = pod.dest("models")
        args = [f"modelpack://{proxy.host}/kserve/kill@{digest}", str(dest)]
        proc = start_initializer(pod, args, env)
        ingest = pod.node_cache / "ingest"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            partial = sum(p.stat().st_size for p in ingest.glob("*.partial")) if ingest.exists() else 0
            if partial > 300_000:
                break
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.02)
        time.sleep(0.5)  # at least two progress intervals
        os.kill(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == -signal.SIGKILL
        # kubectl logs: whole lines, no carriage returns or escape sequences, how far it got
        progress = [line for line in out.splitlines() if ": downloaded " in line]
        assert progress and "\r" not in out and "\x1b" not in out
        assert all(
            line.startswith(f"[1/1] {args[0]} → {dest}: downloaded ") and line.endswith("/s")
            for line in progress
        )
        partials = {"sha256:" + p.name.split(".")[0]: p.stat().st_size for p in ingest.glob("*.partial")}
        committed = {"sha256:" + p.name for p in (pod.node_cache / "blobs" / "sha256").iterdir()}
        assert partials and not pod.files(dest)  # nothing at DEST before the model is verified

        manifest = _manifest(registry, "kserve/kill", digest, plain=True)
        sizes = {str(layer.digest): layer.size for layer in manifest.layers}
        sizes[str(manifest.config.digest)] = manifest.config.size
        proxy.rate = None
        proxy.wait_idle()
        proxy.clear()
        mark = registry.log_mark()
        rerun = run_initializer(pod, args, env)
        assert rerun.returncode == 0, rerun.stderr
        missing = {d: s for d, s in sizes.items() if d not in committed}
        assert sum(proxy.blob_bytes.values()) == sum(missing.values()) - sum(
            partials.get(d, 0) for d in missing
        )
        gets = blob_gets(registry, mark)
        assert set(gets) <= set(missing)  # a committed blob is never asked for again
        for d, n in partials.items():
            if n:
                assert 206 in gets[d] and proxy.blob_bytes[d] == sizes[d] - n  # a Range request for the rest
        expected = _expected_files(manifest)
        assert {n: _sha(c) for n, c in pod.files(dest).items()} == expected
    finally:
        proxy.close()


def test_plain_http_needs_the_explicit_setting_and_bad_settings_fail_closed(pod: Pod, tmp_path: Path) -> None:
    dest = pod.dest("models")
    uri = "modelpack://registry.example/kserve/x:v1"
    for env, words in (
        (kserve_env(pod, MODELPACK_POLICY=str(pod.root / "missing.yaml")), "MODELPACK_POLICY"),
        (kserve_env(pod, MODELPACK_PLAIN_HTTP="maybe"), "MODELPACK_PLAIN_HTTP"),
        (
            kserve_env(pod, KSERVE_OCI_DOCKER_CONFIG=str(pod.auth_dir / "config.json")),
            "KSERVE_OCI_DOCKER_CONFIG",
        ),
    ):
        run = run_initializer(pod, [uri, str(dest)], env)
        assert run.returncode == 2 and len(run.stderr.splitlines()) == 1 and words in run.stderr
    for args in (
        [uri],
        [uri, str(dest), uri],
        ["modelpack://noregistry/x:v1", str(dest)],
        ["https://x.example/m", str(dest)],
    ):
        run = run_initializer(pod, args, kserve_env(pod))
        assert run.returncode == 2 and len(run.stderr.splitlines()) == 1, run.stderr


def test_a_node_cache_another_uid_created_vouches_for_nothing(
    registry_factory, pod: Pod, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """The hostPath is shared with every pod on the node: a tenant running as another uid that
    creates the cache directory first (and edits the snapshot it owns) must not decide what
    another pod's DEST receives."""
    registry = registry_factory.start(basic_auth=True, tls=True)
    digest = _push(registry, tmp_path, "kserve/tenant", seed=7, shards=1)
    _tls_pod(pod, registry)
    os.chown(pod.root / "node", 0, 0)
    os.chmod(pod.root / "node", 0o1777)  # a shared hostPath parent (root-owned, sticky, like /tmp)
    os.chmod(pod.auth_dir / "config.json", 0o444)
    uri = f"modelpack://{registry.host}/kserve/tenant@{digest}"
    env = kserve_env(pod, MODELPACK_CACHE=str(pod.node_cache))
    tenant_dest = pod.root / "node" / "tenant-dest"
    tenant = run_initializer(pod, [uri, str(tenant_dest)], env, uid=2000)
    assert tenant.returncode == 0, tenant.stderr
    snapshot = next(p for p in (pod.node_cache / "snapshots").iterdir() if p.is_dir())
    weights = next(snapshot.glob("*.safetensors"))
    os.chmod(weights, 0o644)  # the tenant owns its cache: it may rewrite what it published
    with open(weights, "r+b") as f:
        f.seek(100)
        f.write(b"\xff" * 16)

    dest = pod.dest("models")
    victim = run_initializer(pod, [uri, str(dest)], env)
    assert victim.returncode != 0
    assert (
        len(victim.stderr.splitlines()) == 1
        and str(pod.node_cache) in victim.stderr
        and "uid 2000" in victim.stderr
    )
    assert not dest.exists() or pod.files(dest) == {}


def test_stale_files_and_planted_links_in_dest_are_replaced_never_followed(
    registry_factory, pod: Pod, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """DEST left by an older version (a LocalModelNode PVC folder, a restarted init container):
    a file of the right size with other bytes is replaced, a symlink at a model path is replaced
    by the verified file and its target is left alone, a killed run's temp file is removed."""
    registry = registry_factory.start(basic_auth=True, tls=True)
    digest = _push(registry, tmp_path, "kserve/stale", seed=8, shards=2)
    _tls_pod(pod, registry)
    expected = _expected_files(_manifest(registry, "kserve/stale", digest))
    weights = sorted(n for n in expected if n.endswith(".safetensors"))
    outside = pod.root / "node" / "outside.bin"
    outside.write_bytes(b"keep me")
    os.chown(outside, 1000, 1000)
    uri = f"modelpack://{registry.host}/kserve/stale@{digest}"
    for cached in (True, False):
        dest = pod.dest("cached" if cached else "direct")
        dest.mkdir()
        size = len(Path(registry.blob_data_path(expected[weights[0]])).read_bytes())
        (dest / weights[0]).write_bytes(b"\0" * size)
        (dest / weights[1]).symlink_to(outside)
        (dest / f".tmp-modelpack-kserve-{weights[0]}").write_bytes(b"left by a killed run")
        from tests.kserve_support import chown_tree

        chown_tree(dest)
        env = kserve_env(pod, MODELPACK_CACHE=str(pod.node_cache) if cached else None)
        run = run_initializer(pod, [uri, str(dest)], env)
        assert run.returncode == 0, run.stderr
        assert {n: _sha(c) for n, c in pod.files(dest).items() if not n.startswith(".tmp-")} == expected
        assert not (dest / weights[1]).is_symlink()
        assert outside.read_bytes() == b"keep me"
        if cached:
            assert not any(p.name.startswith(".tmp-") for p in dest.iterdir())


def test_a_download_job_takes_its_policy_from_the_environment_and_urls_can_skip_the_weights(
    registry_factory, pod: Pod, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """The LocalModelNode agent's Job mounts nothing but the PVC (it replaces the container's
    volumeMounts), so the policy comes as text (``MODELPACK_POLICY_YAML`` from a ConfigMap key,
    keys inline) and there is no writable ``$TMPDIR``; ``?exclude=*.safetensors`` gives vLLM's
    config files only, for an InferenceService that streams the weights."""
    registry = registry_factory.start(basic_auth=True, tls=True)
    ckpt = tmp_path / "job"
    write_checkpoint(str(ckpt), SyntheticSpec(seed=9, shards=2))
    signer = generate_key()
    digest = api.push(
        str(ckpt), registry.ref("kserve/job", "v1"), target_options=_options(registry), sign_key=signer
    ).digest
    _tls_pod(pod, registry)
    pod.writable.remove(pod.tmp)
    uri = f"modelpack://{registry.host}/kserve/job@{digest}"

    def policy(pem: str) -> str:
        indented = "\n".join("          " + line for line in pem.strip().splitlines())
        return (
            f"rules:\n  - match: '{registry.host}/kserve/*'\n    keys:\n      - pem: |\n{indented}\n"
            "    require_signature: true\n"
        )

    other = run_initializer(
        pod,
        [uri, str(pod.dest("refused"))],
        kserve_env(pod, TMPDIR=None, MODELPACK_POLICY_YAML=policy(generate_key().public.pem.decode())),
    )
    assert other.returncode == 1 and len(other.stderr.splitlines()) == 1, other.stderr
    assert not pod.dest("refused").exists() or pod.files(pod.dest("refused")) == {}
    env = kserve_env(pod, MODELPACK_POLICY_YAML=policy(signer.public.pem.decode()))
    env.pop("TMPDIR")
    dest = pod.dest("models")
    accepted = run_initializer(pod, [uri, str(dest)], env)
    assert accepted.returncode == 0, accepted.stderr
    assert pod.files(dest) == {p.name: p.read_bytes() for p in ckpt.iterdir()}
    configs = pod.dest("configs")
    only = run_initializer(pod, [uri + "?exclude=*.safetensors", str(configs)], env)
    assert only.returncode == 0, only.stderr
    assert set(pod.files(configs)) == {p.name for p in ckpt.iterdir() if p.suffix != ".safetensors"}


def test_the_generated_cluster_storage_container_runs_as_written(
    registry_factory, pod: Pod, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """``k8s kserve storage-containers``' own initContainer spec: its command, env and
    securityContext (uid), each volumeMount's path mapped onto the pod's directories."""
    from modelpack.serving.kserve.manifests import storage_containers

    registry = registry_factory.start(basic_auth=True, tls=True)
    ckpt = tmp_path / "csc"
    write_checkpoint(str(ckpt), SyntheticSpec(seed=10, shards=1))
    signer = generate_key()
    digest = api.push(
        str(ckpt), registry.ref("kserve/csc", "v1"), target_options=_options(registry), sign_key=signer
    ).digest
    _tls_pod(pod, registry)
    policy_dir = pod.root / "policy"
    policy_dir.mkdir()
    (policy_dir / "ci.pub").write_bytes(signer.public.pem)
    (policy_dir / "policy.yaml").write_text(
        f"rules:\n  - match: '{registry.host}/kserve/*'\n    keys: [{{path: ci.pub}}]\n    require_signature: true\n"
    )
    os.chmod(policy_dir, 0o755)
    init, _ = storage_containers(image=IMAGE, policy_secret=True, registry_secret=True)
    container = init["spec"]["container"]
    where = {
        "modelpack-cache": str(pod.node_cache),
        "modelpack-tmp": str(pod.tmp),
        "modelpack-policy": str(policy_dir),
        "modelpack-registry-auth": str(pod.auth_dir),
    }
    mounts = {m["mountPath"]: where[m["name"]] for m in container["volumeMounts"]}

    def mapped(value: str) -> str:
        for mount_path, local in mounts.items():
            if value == mount_path or value.startswith(mount_path + "/"):
                return local + value[len(mount_path) :]
        return value

    env = kserve_env(pod)
    env.pop("KSERVE_OCI_DOCKER_CONFIG")  # the CSC itself names the projected pull secret
    env.update({e["name"]: mapped(e["value"]) for e in container["env"]})
    assert container["command"] == ["modelpack", "storage-initializer"]
    assert container["securityContext"]["runAsUser"] == 1000
    dest = pod.dest("models")
    run = run_initializer(pod, [f"modelpack://{registry.host}/kserve/csc@{digest}", str(dest)], env)
    assert run.returncode == 0, run.stderr
    assert pod.files(dest) == {p.name: p.read_bytes() for p in ckpt.iterdir()}
    assert (pod.node_cache / "events.jsonl").exists()


def test_a_cached_file_changed_under_the_cache_is_not_copied_into_dest(
    registry_factory, pod: Pod, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """A copy out of the node cache (the only way across mounts) is hashed against the digest
    the snapshot recorded before it is renamed into DEST: a cached file edited in place (disk
    corruption, an operator's mistake) never reaches a pod unverified."""
    registry = registry_factory.start(basic_auth=True, tls=True)
    digest = _push(registry, tmp_path, "kserve/bitrot", seed=12, shards=1)
    _tls_pod(pod, registry)
    uri = f"modelpack://{registry.host}/kserve/bitrot@{digest}"
    env = kserve_env(pod, MODELPACK_CACHE=str(pod.node_cache), MODELPACK_LINK="copy")
    assert run_initializer(pod, [uri, str(pod.dest("first"))], env).returncode == 0
    snapshot = next(p for p in (pod.node_cache / "snapshots").iterdir() if p.is_dir())
    weights = next(snapshot.glob("*.safetensors"))
    os.chmod(weights, 0o644)
    with open(weights, "r+b") as f:  # root (the test) flips bytes of the cached blob in place
        f.seek(200)
        f.write(b"\x00\xff" * 8)
    os.chmod(weights, 0o444)
    dest = pod.dest("second")
    run = run_initializer(pod, [uri, str(dest)], env)
    assert run.returncode == 1
    assert len(run.stderr.splitlines()) == 1 and weights.name in run.stderr
    assert not (dest / weights.name).exists()
    assert not any(p.name.startswith(".tmp-") for p in dest.rglob("*"))


def test_the_pull_secret_is_bound_to_its_registry_host(registry_factory, pod: Pod, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A storage URI naming another host (here a relay in front of the same registry, which
    would pass any Authorization through) must not receive the pull secret's credentials."""
    registry = registry_factory.start(basic_auth=True)
    digest = _push(registry, tmp_path, "kserve/bound", seed=14, plain=True, shards=1)
    relay = FaultProxy(registry.host)
    try:
        write_docker_config(pod, registry.host, registry.username, registry.password)
        env = kserve_env(pod, MODELPACK_PLAIN_HTTP="true")
        other = run_initializer(
            pod, [f"modelpack://{relay.host}/kserve/bound@{digest}", str(pod.dest("other"))], env
        )
        assert other.returncode == 1 and len(other.stderr.splitlines()) == 1, other.stderr
        assert registry.password not in other.stdout + other.stderr
        assert not any(status in (200, 206) for _, path, status in relay.requests if "/blobs/" in path)
        own = run_initializer(
            pod, [f"modelpack://{registry.host}/kserve/bound@{digest}", str(pod.dest("own"))], env
        )
        assert own.returncode == 0, own.stderr
    finally:
        relay.close()


def test_two_pods_starting_together_on_a_node_download_each_blob_once(
    registry_factory, pod: Pod, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    registry = registry_factory.start(basic_auth=True)
    digest = _push(registry, tmp_path, "kserve/twice", seed=15, plain=True, shards=2, layers=4)
    proxy = FaultProxy(registry.host, rate=2 * 1024 * 1024)  # slow enough for the two to overlap
    try:
        write_docker_config(pod, proxy.host, registry.username, registry.password)
        env = kserve_env(pod, MODELPACK_CACHE=str(pod.node_cache), MODELPACK_PLAIN_HTTP="true")
        uri = f"modelpack://{proxy.host}/kserve/twice@{digest}"
        mark = registry.log_mark()
        procs = [start_initializer(pod, [uri, str(pod.dest(f"pod-{i}"))], env) for i in range(2)]
        for p in procs:
            _, err = p.communicate(timeout=120)
            assert p.returncode == 0, err
        gets = blob_gets(registry, mark)
        manifest = _manifest(registry, "kserve/twice", digest, plain=True)
        assert set(gets) == {str(layer.digest) for layer in manifest.layers} | {str(manifest.config.digest)}
        assert all(statuses.count(200) == 1 for statuses in gets.values()), gets
        assert pod.files(pod.dest("pod-0")) == pod.files(pod.dest("pod-1"))
    finally:
        proxy.close()


def test_a_filtered_uri_with_a_cache_lands_its_blobs_in_the_cache_for_the_next_full_pull(
    registry_factory, pod: Pod, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """``?exclude=`` with a node cache: the selected blobs are written, verified, into the cache's
    store on the way to DEST (the snapshot is left to a full pull, and an event says so); the next
    full pull on the node fetches only the rest."""
    from modelpack.mediatypes.annotations import layer_filepath

    registry = registry_factory.start(basic_auth=True, tls=True)
    digest = _push(registry, tmp_path, "kserve/tee", seed=10, shards=2)
    _tls_pod(pod, registry)
    env = kserve_env(pod, MODELPACK_CACHE=str(pod.node_cache))
    uri = f"modelpack://{registry.host}/kserve/tee@{digest}"
    manifest = _manifest(registry, "kserve/tee", digest)
    small = {
        str(layer.digest)
        for layer in manifest.layers
        if not (layer_filepath(layer.annotations) or "").endswith(".safetensors")
    }
    configs = pod.dest("configs")
    first = run_initializer(pod, [uri + "?exclude=*.safetensors", str(configs)], env)
    assert first.returncode == 0, first.stderr
    assert {_sha(d) for d in pod.files(configs).values()} == small
    committed = {"sha256:" + p.name for p in (pod.node_cache / "blobs" / "sha256").iterdir()}
    assert small <= committed
    assert not (pod.node_cache / "snapshots" / f"{digest[7:]}.ready").exists()
    left = [e for e in read_events(str(pod.node_cache / "events.jsonl")) if e["event"] == "kserve.cache_left"]
    assert left and left[0]["left_to"] == "fill" and set(left[0]["blobs"]) == small

    mark = registry.log_mark()
    full = run_initializer(pod, [uri, str(pod.dest("models"))], env)
    assert full.returncode == 0, full.stderr
    fetched = set(blob_gets(registry, mark))
    assert fetched and not fetched & small  # what the filtered run cached is not fetched again
