"""The pre-warm DaemonSet serves each node's cache to its peers.

``modelpack k8s prewarm … --serve-peers PORT`` adds a ``cache serve`` container (cache mounted
read-only) to every pod, points the pod's pulls at the other nodes first through the headless
Service it emits (``dns+http://NAME-peers.NS.svc:PORT``, ordered per node by
``MODELPACK_NODE_NAME``) and validates both objects against the Kubernetes client models, as
every generated object is. Before, there was no such option.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml
from click.testing import CliRunner
from modelpack.mount import k8s

from modelpack.cli import main
from tests.mount.k8s_images import IMAGE

REF = "registry.example.com/models/llama@sha256:" + "ab" * 32


def test_prewarm_serve_peers_emits_a_headless_service_and_a_serving_container(tmp_path: Path) -> None:
    out = CliRunner().invoke(
        main,
        [
            *("k8s", "prewarm", REF, "--node-selector", "pool=gpu", "--namespace", "ml"),
            *("--serve-peers", "5050", "--peer-token-secret", "peers", "--modelpack-image", IMAGE),
        ],
    )
    assert out.exit_code == 0, out.output
    service, ds = list(yaml.safe_load_all(out.output))
    k8s.validate(service)
    model = k8s.validate(ds)
    assert service["kind"] == "Service" and service["spec"]["clusterIP"] == "None"
    assert service["metadata"]["name"] == "modelpack-prewarm-peers"
    assert service["spec"]["selector"] == ds["spec"]["template"]["metadata"]["labels"]
    prewarm, serve = model.spec.template.spec.containers
    assert serve.command[:3] == ["modelpack", "cache", "serve"] and serve.ports[0].container_port == 5050
    # the server fills the pinned reference's blobs on a miss: only this container
    # writes the cache, the root filesystems stay read-only
    assert serve.command[serve.command.index("--fill") + 1] == REF
    assert serve.volume_mounts[0].read_only is False
    assert prewarm.volume_mounts[0].read_only is None
    assert serve.security_context.read_only_root_filesystem is True
    assert prewarm.security_context.read_only_root_filesystem is True
    assert serve.readiness_probe.tcp_socket.port == 5050  # /v2/ too needs the token
    env = {e.name: e for e in prewarm.env}
    assert env["MODELPACK_MIRRORS"].value == "dns+http://modelpack-prewarm-peers.ml.svc:5050"
    assert env["MODELPACK_NODE_NAME"].value_from.field_ref.field_path == "spec.nodeName"
    assert env["MODELPACK_NODE_IP"].value_from.field_ref.field_path == "status.podIP"
    assert env["MODELPACK_PEER_ORDER"].value == "blob"  # each blob asked of its owner, which fills it

    # the serving container's flags are the real command's: they parse, and on a node with no
    # cache yet it starts (it creates the cache) and prints its URL
    argv = [a if a != "/var/cache/modelpack" else str(tmp_path / "none") for a in serve.command[1:]]
    argv = [a if not a.startswith("0.0.0.0:") else "127.0.0.1:0" for a in argv]
    proc = subprocess.Popen(
        [sys.executable, "-m", "modelpack.cli", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, MODELPACK_SERVE_TOKEN="t0ken"),
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().startswith("http://127.0.0.1:")
    finally:
        proc.terminate()
        proc.wait(timeout=30)

    plain = CliRunner().invoke(
        main, ["k8s", "prewarm", REF, "--node-selector", "pool=gpu", "--modelpack-image", IMAGE]
    )
    assert plain.exit_code == 0 and len(list(yaml.safe_load_all(plain.output))) == 1
    assert len(k8s.validate(yaml.safe_load(plain.output)).spec.template.spec.containers) == 1


def test_prewarm_serve_peers_fills_only_digests_with_the_pods_registry_credentials() -> None:
    tag = "registry.example.com/models/llama:v1"
    both = k8s.prewarm_daemonset(
        [REF, tag],
        node_selector={"pool": "gpu"},
        serve_port=5050,
        registry_secret="regcred",
        policy_secret="pol",
        modelpack_image=IMAGE,
        peer_token_secret="peers",
    )
    model = k8s.validate(both)
    _prewarm, serve = model.spec.template.spec.containers
    fills = [serve.command[i + 1] for i, a in enumerate(serve.command) if a == "--fill"]
    assert fills == [REF]  # a tag is never filled: a peer never chooses a version
    assert {e.name: e.value for e in serve.env}["DOCKER_CONFIG"]  # the origin is asked as this pod
    mounts = {m.name: m for m in serve.volume_mounts}
    assert mounts["registry-credentials"].read_only is True and "trust-policy" not in mounts

    tags_only = k8s.validate(
        k8s.prewarm_daemonset(
            [tag],
            node_selector={"pool": "gpu"},
            serve_port=5050,
            modelpack_image=IMAGE,
            peer_token_secret="p",
        )
    )
    prewarm, serve = tags_only.spec.template.spec.containers
    assert "--fill" not in serve.command and serve.volume_mounts[0].read_only is True  # nothing to fill
    assert "MODELPACK_PEER_ORDER" not in {e.name for e in prewarm.env}
