"""Run ``modelpack storage-initializer`` the way KServe runs it, for the KServe tests.

A pod is simulated with real parts: the process runs as uid 1000 (``setpriv``, the stock
storage-initializer image's user) in its own mount namespace whose root filesystem is
remounted read-only (``readOnlyRootFilesystem``), with only the pod's volumes writable: DEST
(the emptyDir KServe mounts at ``/mnt/models``), the node cache (a hostPath) and ``$TMPDIR``.
The argv is exactly KServe's ``[SRC_URI, DEST_PATH, …]`` after the ClusterStorageContainer's
``command``; the environment is what the webhook sets (the CSC's env, the CA bundle variables,
KServe's default Hugging Face variables) plus ``KSERVE_OCI_DOCKER_CONFIG`` for the projected
pull secret.
"""

from __future__ import annotations

import base64
import json
import os
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
MODELPACK = str(REPO_ROOT / ".venv" / "bin" / "modelpack")
KSERVE_UID = 1000


def as_uid(uid: int) -> list[str]:
    return ["/usr/bin/setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]


# what utils.AddDefaultHuggingFaceEnvVars adds to every storage-initializer container
KSERVE_HF_ENV = {
    "HF_HUB_ENABLE_HF_TRANSFER": "1",
    "HF_XET_HIGH_PERFORMANCE": "1",
    "HF_XET_NUM_CONCURRENT_RANGE_GETS": "8",
}
# where the webhook mounts the projected pull secret (oci_fetch.go ociFetchDockerConfigDir)
DOCKER_CONFIG_DIR = "oci-fetch-auth"


@dataclass
class Pod:
    """The volumes of one simulated pod on one node (every path under ``root``)."""

    root: Path
    node_cache: Path
    auth_dir: Path
    ca_dir: Path
    tmp: Path
    writable: list[Path] = field(default_factory=list)

    def dest(self, name: str = "models") -> Path:
        """A DEST under the pod's model volume (``/mnt/models`` in KServe)."""
        return self.root / "mnt" / name

    def files(self, dest: Path) -> dict[str, bytes]:
        return {
            p.relative_to(dest).as_posix(): p.read_bytes() for p in sorted(dest.rglob("*")) if p.is_file()
        }


def chown_tree(path: Path, uid: int = KSERVE_UID) -> None:
    os.chown(path, uid, uid)
    for p in path.rglob("*"):
        os.chown(p, uid, uid, follow_symlinks=False)


def pod_volumes() -> Iterator[Pod]:
    """The volumes of a fresh pod (a generator for a fixture: removed afterwards)."""
    base = Path(tempfile.mkdtemp(prefix="mp-kserve-", dir="/tmp"))
    os.chmod(base, 0o755)
    p = Pod(
        root=base,
        node_cache=base / "node" / "modelpack-cache",
        auth_dir=base / DOCKER_CONFIG_DIR,
        ca_dir=base / "custom-certs",
        tmp=base / "tmp",
    )
    for d in (base / "mnt", base / "node", p.auth_dir, p.ca_dir, p.tmp):
        d.mkdir(parents=True)
        os.chmod(d, 0o755)
    for d in (base / "mnt", base / "node", p.tmp):
        os.chown(d, KSERVE_UID, KSERVE_UID)  # emptyDir / hostPath writable by the pod's uid (fsGroup)
    p.writable = [base / "mnt", base / "node", p.tmp]
    try:
        yield p
    finally:
        shutil.rmtree(base, ignore_errors=True)


def write_docker_config(pod: Pod, host: str, user: str, password: str) -> Path:
    """The pull secret as KServe projects it: ``config.json``, mode 0400, the container's uid."""
    path = pod.auth_dir / "config.json"
    auth = base64.b64encode(f"{user}:{password}".encode()).decode()
    path.write_text(json.dumps({"auths": {host: {"auth": auth}}}))
    os.chmod(path, 0o400)
    os.chown(path, KSERVE_UID, KSERVE_UID)
    return path


def kserve_env(pod: Pod, **extra: str | None) -> dict[str, str]:
    """The container's environment: the CSC's env (``extra``), KServe's own variables."""
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": "/home/kserve",  # the image's home: not writable under a read-only root
        "TMPDIR": str(pod.tmp),
        **KSERVE_HF_ENV,
    }
    if (pod.auth_dir / "config.json").exists():
        env["KSERVE_OCI_DOCKER_CONFIG"] = str(pod.auth_dir / "config.json")
    if (pod.ca_dir / "cabundle.crt").exists():
        env["CA_BUNDLE_CONFIGMAP_NAME"] = "kserve-global-ca-bundle"
        env["CA_BUNDLE_VOLUME_MOUNT_POINT"] = str(pod.ca_dir)
    env.update({k: v for k, v in extra.items() if v is not None})
    return env


def initializer_argv(pod: Pod, args: list[str], env: dict[str, str], uid: int = KSERVE_UID) -> list[str]:
    """``unshare -m``: bind the pod's writable volumes onto themselves, remount ``/`` read-only,
    then become uid 1000 with exactly ``env`` and exec the CSC's command with KServe's args."""
    binds = " && ".join(f"mount --bind {shlex.quote(str(d))} {shlex.quote(str(d))}" for d in pod.writable)
    # env -i before setpriv: setpriv itself must exec the CLI (the venv's interpreter lives under
    # a root-only directory that a second exec by uid 1000 could not traverse)
    inner = [
        "env",
        "-i",
        *(f"{k}={v}" for k, v in env.items()),
        *as_uid(uid),
        MODELPACK,
        "storage-initializer",
        *args,
    ]
    script = f"mount --make-rprivate / && {binds} && mount -o remount,bind,ro / && exec {shlex.join(inner)}"
    return ["unshare", "--mount", "sh", "-c", script]


def run_initializer(
    pod: Pod, args: list[str], env: dict[str, str], timeout: float = 120, uid: int = KSERVE_UID
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        initializer_argv(pod, args, env, uid), capture_output=True, text=True, timeout=timeout, check=False
    )


def start_initializer(pod: Pod, args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        initializer_argv(pod, args, env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def blob_gets(registry, mark: int) -> dict[str, list[int]]:  # type: ignore[no-untyped-def]
    """Blob GETs in the registry's access log after ``mark``: digest → statuses."""
    out: dict[str, list[int]] = {}
    for method, path, status in registry.requests_since(mark):
        if method == "GET" and "/blobs/sha256:" in path:
            out.setdefault(path.rsplit("/", 1)[1], []).append(status)
    return out
