"""``modelpack k8s kserve …``: every object validates against KServe's own CRD schemas (vendored
byte for byte, ``tests/fixtures/kserve-crds/PROVENANCE.yaml``) and, where it embeds core
objects (containers, volumes, PV and PVC specs), against Kubernetes' published schemas in
strict mode.

Structural CRD schemas do not reject unknown fields, the API server prunes them silently: a
misspelled field would vanish on ``kubectl apply``. ``_pruned`` finds every field of an object
that its CRD schema does not declare, so a test fails where the API server would drop it.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import jsonschema
import kubernetes_validate as kv  # declared test dependency: missing is a failure, not a skip
import pytest
import yaml
from click.testing import CliRunner

from modelpack.cli import main
from modelpack.errors import K8sError
from modelpack.serving.kserve.manifests import inference_service, storage_containers
from modelpack.serving.kserve.uri import parse_storage_uri
from tests.mount.k8s_images import IMAGE, SERVING, with_images
from tests.paths import FIXTURES

CRDS = FIXTURES / "kserve-crds"
DIGEST = "sha256:" + "ab" * 32
REF = f"registry.example.com/models/llama@{DIGEST}"
K8S = kv.latest_version()


def _crd_schemas() -> dict[str, dict[str, Any]]:
    """kind → openAPIV3Schema of its served version, from the vendored CRDs."""
    out = {}
    for path in sorted(CRDS.glob("*.yaml")):
        if path.name == "PROVENANCE.yaml":
            continue
        crd = yaml.safe_load(path.read_text())
        version = next(v for v in crd["spec"]["versions"] if v.get("served") and v.get("storage", True))
        out[crd["spec"]["names"]["kind"]] = {
            "apiVersion": f"{crd['spec']['group']}/{version['name']}",
            "schema": version["schema"]["openAPIV3Schema"],
        }
    return out


SCHEMAS = _crd_schemas()


def _pruned(obj: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    """Paths of fields the API server would prune (not declared by the structural schema)."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    out: list[str] = []
    if isinstance(obj, dict):
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        for key, value in obj.items():
            if props is not None and key in props:
                out += _pruned(value, props[key], f"{path}.{key}")
            elif isinstance(extra, dict):
                out += _pruned(value, extra, f"{path}.{key}")
            elif path != ".metadata" and not (path == "" and key in ("apiVersion", "kind")):
                out.append(f"{path}.{key}")
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(obj):
            out += _pruned(item, schema["items"], f"{path}[{i}]")
    return out


def _check_crd_object(obj: dict[str, Any]) -> None:
    entry = SCHEMAS[obj["kind"]]
    assert obj["apiVersion"] == entry["apiVersion"]
    jsonschema.Draft7Validator(entry["schema"]).validate(obj)
    assert _pruned(obj, entry["schema"]) == [], obj["kind"]


def _check_core(kind: str, body: dict[str, Any]) -> None:
    doc = {"apiVersion": "v1", "kind": kind, "metadata": {"name": "x"}, **body}
    kv.validate(doc, K8S, strict=True)


@pytest.fixture(autouse=True)
def _modelpack_image(monkeypatch: pytest.MonkeyPatch) -> None:
    """The modelpack image is the user's setting: these tests give it through MODELPACK_IMAGE."""
    monkeypatch.setenv("MODELPACK_IMAGE", IMAGE)


def _emitted(args: list[str]) -> list[dict[str, Any]]:
    res = CliRunner().invoke(main, with_images(["k8s", "kserve", *args, "--json"]))
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    return doc if isinstance(doc, list) else [doc]


def test_the_vendored_crds_are_the_ones_provenance_names() -> None:
    provenance = yaml.safe_load((CRDS / "PROVENANCE.yaml").read_text())
    assert provenance["repository"] == "https://github.com/kserve/kserve" and len(provenance["commit"]) == 40
    files = {f["file"]: f for f in provenance["files"]}
    assert set(files) == {p.name for p in CRDS.glob("*.yaml")} - {"PROVENANCE.yaml"}
    for name, entry in files.items():
        assert hashlib.sha256((CRDS / name).read_bytes()).hexdigest() == entry["sha256"], name
        assert entry["path"].startswith("config/crd/full/") and entry["path"].endswith(name)
    assert set(SCHEMAS) == {
        "ClusterStorageContainer",
        "InferenceService",
        "LocalModelCache",
        "LocalModelNodeGroup",
    }


@pytest.mark.parametrize(
    "args",
    [
        ["storage-containers"],
        ["storage-containers", "--policy-secret", "--registry-secret", "--job-policy-configmap", "trust"],
        ["storage-containers", "--prefix", "modelpack://registry.example.com/", "--plain-http"],
    ],
)
def test_storage_containers_validate_and_follow_the_contract(args: list[str]) -> None:
    objs = _emitted(args)
    assert [o["spec"]["workloadType"] for o in objs] == ["initContainer", "localModelDownloadJob"]
    for obj in objs:
        _check_crd_object(obj)
        container = obj["spec"]["container"]
        assert container["command"] == ["modelpack", "storage-initializer"] and "args" not in container
        assert container["securityContext"]["runAsUser"] == 1000
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        assert obj["spec"]["supportsMultiModelDownload"] is True
        _check_core("Pod", {"spec": {"containers": [container]}})
    _, job = objs
    assert "volumeMounts" not in job["spec"]["container"]  # the agent replaces them with the PVC's


@pytest.mark.parametrize("weights", ["initializer", "stream"])
def test_the_inference_service_validates_pins_the_digest_and_declares_the_csc_volumes(weights: str) -> None:
    (isvc,) = _emitted(
        [
            *(
                "inferenceservice",
                REF,
                "--name",
                "llama",
                "--weights",
                weights,
                "--tensor-parallel-size",
                "2",
            ),
            *("--policy-secret", "trust", "--registry-secret", "regcred"),
        ]
    )
    _check_crd_object(isvc)
    predictor = isvc["spec"]["predictor"]
    _check_core("Pod", {"spec": predictor})
    (server,) = predictor["containers"]
    assert server["name"] == "kserve-container"
    uri = next(e["value"] for e in server["env"] if e["name"] == "STORAGE_URI")
    parsed = parse_storage_uri(uri)
    assert str(parsed.reference.digest) == DIGEST and parsed.reference.tag is None
    assert parsed.exclude == (("*.safetensors",) if weights == "stream" else ())
    extra = json.loads(server["command"][server["command"].index("--model-loader-extra-config") + 1])
    assert extra["expected_digest"] == DIGEST
    assert (extra.get("source") == REF) is (weights == "stream")
    # every volume the initContainer CSC mounts (with the same flags) is declared by the pod
    (init, _) = storage_containers(image=IMAGE, policy_secret=True, registry_secret=True)
    declared = {v["name"] for v in predictor["volumes"]}
    assert {m["name"] for m in init["spec"]["container"]["volumeMounts"]} <= declared


def test_local_model_cache_and_node_group_validate_and_share_the_pinned_uri() -> None:
    group, cache = _emitted(
        [
            *("localmodelcache", REF, "--name", "llama", "--node-group", "gpus", "--model-size", "20Gi"),
            *("--node-selector", "nvidia.com/gpu.present=true"),
        ]
    )
    for obj in (group, cache):
        _check_crd_object(obj)
    _check_core("PersistentVolume", {"spec": group["spec"]["persistentVolumeSpec"]})
    _check_core("PersistentVolumeClaim", {"spec": group["spec"]["persistentVolumeClaimSpec"]})
    assert cache["spec"]["nodeGroups"] == ["gpus"]
    isvc = inference_service(REF, name="llama", image=SERVING)
    uri = next(
        e["value"] for e in isvc["spec"]["predictor"]["containers"][0]["env"] if e["name"] == "STORAGE_URI"
    )
    assert cache["spec"]["sourceModelUri"] == uri  # KServe matches the cache by this exact string


def test_the_checks_are_strict_enough_to_fail() -> None:
    (init, _) = storage_containers(image=IMAGE)
    misspelled = json.loads(json.dumps(init))
    misspelled["spec"]["supportsMultiModelDownloads"] = misspelled["spec"].pop("supportsMultiModelDownload")
    jsonschema.Draft7Validator(SCHEMAS["ClusterStorageContainer"]["schema"]).validate(misspelled)  # passes…
    assert _pruned(misspelled, SCHEMAS["ClusterStorageContainer"]["schema"]) == [
        ".spec.supportsMultiModelDownloads"
    ]
    with pytest.raises(AssertionError):
        _check_crd_object(misspelled)  # …but the API server would drop the field: refused here
    wrong_type = json.loads(json.dumps(init))
    wrong_type["spec"]["supportsMultiModelDownload"] = "yes"
    with pytest.raises(jsonschema.ValidationError):
        _check_crd_object(wrong_type)
    container = dict(init["spec"]["container"], volumeMount=[])
    with pytest.raises(kv.ValidationError):
        _check_core("Pod", {"spec": {"containers": [container]}})


@pytest.mark.parametrize(
    "args",
    [
        ["inferenceservice", "registry.example.com/models/llama:v1", "--name", "x"],
        [
            *("localmodelcache", "registry.example.com/models/llama:v1", "--name", "x", "--node-group", "g"),
            *("--model-size", "1Gi", "--node-selector", "a=b"),
        ],
        ["inferenceservice", "oci:/srv/layout@" + DIGEST, "--name", "x"],
    ],
)
def test_an_unpinned_or_non_registry_reference_is_refused(args: list[str]) -> None:
    res = CliRunner().invoke(main, with_images(["k8s", "kserve", *args]))
    assert res.exit_code == 1 and res.output.startswith("error: ") and len(res.output.splitlines()) == 1


def test_an_empty_prefix_would_take_every_uri_and_is_refused() -> None:
    with pytest.raises(K8sError):
        storage_containers(image=IMAGE, prefix="")
