"""Push and pull throughput: modelpack vs skopeo, modelpack-client and the curl ceiling, against
the same local registry in the same run.

A generated checkpoint (default 512 MiB: ``make bench`` stays within minutes; ``--size 2G`` or
more for the issue-16 numbers) is pushed and pulled by each tool, each run as its own child
process whose peak RSS (VmHWM) is read from /proc:

  push   modelpack push DIR → registry       (packs on the fly: hashing is included)
         modelpack cp oci:LAYOUT → registry   (like for like with skopeo)
         skopeo copy oci:LAYOUT → registry
  pull   modelpack pull registry → DIR        (verified files at their paths)
         modelpack cp registry → oci:LAYOUT   (like for like with skopeo)
         skopeo copy registry → oci:LAYOUT
         modelpack-client pull registry → DIR (PyPI, from .venv-peers: sequential, no fsync)
         modelpack pull modelcar → DIR        (the same checkpoint pushed --format image: tar layers
                                               under models/, verified and fsynced; peer: kserve-storage)
         kserve-storage modelcar → DIR        (KServe's own OCI fetch, from .venv-peers: verifies
                                               nothing, fsyncs nothing; benchmarks/modelcar_peer.py)
         curl ceiling: the layer blobs fetched to files by ``curl -s -o FILE URL``, 4 at a time
         (``xargs -P 4``), and nothing else: no manifest, no hashing, no fsync. This is what the
         registry can serve on this machine; pull rows print their ratio to it.

Each push goes to a fresh registry process on fresh storage (same binary and config), so no
tool finds blobs another tool already stored. Rounds rotate the order of the contenders; a row
shows the best and the median time of its rounds, throughput (best), the ratio to its peer
(push: skopeo; pull: the curl ceiling, best against best) and the peak RSS (for the curl
ceiling: the largest single curl process). ``os.sync()`` runs, untimed, before every transfer.
A second ceiling row adds what any verifying client pays on top of curl: each blob is piped
through ``tee FILE`` into ``openssl dgst -sha256``.

  .venv/bin/python benchmarks/transfer.py [--size 512M] [--shards 4] [--jobs 4] [--rounds 3] [--pull-only]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from modelcar_peer import PEER_CAVEAT, kserve_storage, peer_available  # noqa: E402

from modelpack import api  # noqa: E402
from modelpack.cli import parse_size  # noqa: E402
from modelpack.testdata.synthetic import SyntheticSpec, write_checkpoint  # noqa: E402
from tests.fixtures.registry import RegistryServer, start_registry  # noqa: E402

MODELPACK = [sys.executable, "-c", "from modelpack.cli import main; main()"]
SKOPEO = ["skopeo", "copy", "--preserve-digests"]
PEERS_PYTHON = ROOT / ".venv-peers" / "bin" / "python"
CLIENT = [str(PEERS_PYTHON), "-m", "modelpack_client", "--insecure"]
CURL_PARALLEL = 4


def _vm_hwm(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def _children(pid: int) -> list[int]:
    """The child processes of ``pid`` (every thread's), from /proc."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
        except (OSError, ValueError):
            pass
    return out


def _tree_hwm(pid: int) -> int:
    """The largest VmHWM of ``pid`` and its descendants (one process's peak, not a sum)."""
    peak, todo = 0, [pid]
    while todo:
        p = todo.pop()
        peak = max(peak, _vm_hwm(p))
        todo += _children(p)
    return peak


def run_child(
    cmd: list[str], env: dict[str, str], *, tree: bool = False, cwd: str | None = None
) -> tuple[float, int]:
    """Run ``cmd``; return (seconds, peak RSS in bytes) of that child alone (``tree``: of the
    largest process below it, for the curl ceiling's ``xargs`` of curls).

    Peak RSS is the child's ``VmHWM`` polled from /proc (``ru_maxrss`` would include the
    benchmark's own memory: a forked child inherits its parent's high-water mark until exec).
    Dirty pages left by the previous transfer are flushed first (untimed): otherwise whichever
    tool runs next pays for its predecessor's writeback.
    """
    os.sync()
    start = time.perf_counter()
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err, cwd=cwd)
        peak = 0
        while proc.poll() is None:
            peak = max(peak, _tree_hwm(proc.pid) if tree else _vm_hwm(proc.pid))
            time.sleep(0.01)
        seconds = time.perf_counter() - start
        if proc.returncode != 0:
            err.seek(0)
            tail = err.read()[-2000:].decode(errors="replace")
            raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{tail}")
    return seconds, peak


def drop_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def curl_ceiling(host: str, repo: str, layers: list[tuple[str, int]], dest: Path) -> list[str]:
    """The ceiling: every layer blob fetched to a file by curl, ``CURL_PARALLEL`` at a time."""
    args: list[str] = []
    for i, (digest, _) in enumerate(layers):
        args += [str(dest / f"blob{i}"), f"http://{host}/v2/{repo}/blobs/{digest}"]
    script = f'mkdir -p "{dest}" && printf "%s\\n" "$@" | xargs -d "\\n" -P {CURL_PARALLEL} -n 2 curl -sf -o'
    return ["sh", "-c", script, "curl-ceiling", *args]


def baseline_tree(rev: str, where: Path, env: dict[str, str]) -> str:
    """``modelpack`` as of ``rev``, laid out as the installed package (the top-level folders
    ``mediatypes/`` … inside it, as pyproject's package-dir maps them); returns the PYTHONPATH."""
    src = where / "src"
    src.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive.stdout, check=True)
    pkg = where / "pkg"
    shutil.copytree(src / "modelpack", pkg / "modelpack")
    for sub in ("mediatypes", "signing", "mount", "loader"):
        shutil.copytree(src / sub, pkg / "modelpack" / sub)
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(pkg)], env=env, check=True)
    return str(pkg)


def verified_ceiling(host: str, repo: str, layers: list[tuple[str, int]], dest: Path) -> list[str]:
    """The curl ceiling plus what any verifying client must add: each blob streamed through
    ``tee FILE`` into ``openssl dgst -sha256`` (OpenSSL's SHA-NI/AVX2 code), 4 at a time."""
    args: list[str] = []
    for i, (digest, _) in enumerate(layers):
        args += [str(dest / f"blob{i}"), f"http://{host}/v2/{repo}/blobs/{digest}"]
    one = 'curl -sf "$2" | tee "$1" | openssl dgst -sha256 >/dev/null'
    script = (
        f'mkdir -p "{dest}" && printf "%s\\n" "$@" | '
        f"xargs -d '\\n' -P {CURL_PARALLEL} -n 2 sh -c '{one}' one"
    )
    return ["sh", "-c", script, "verified-ceiling", *args]


def manifest_layers(host: str, repo: str, tag: str) -> list[tuple[str, int]]:
    accept = "application/vnd.oci.image.manifest.v1+json"
    out = subprocess.run(
        ["curl", "-sf", "-H", f"Accept: {accept}", f"http://{host}/v2/{repo}/manifests/{tag}"],
        check=True,
        capture_output=True,
    ).stdout
    return [(layer["digest"], layer["size"]) for layer in json.loads(out)["layers"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="512M", help="checkpoint size (default 512M)")
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--jobs", type=int, default=4, help="modelpack --jobs")
    ap.add_argument("--rounds", type=int, default=3, help="repeat (rotating the order); best time per tool")
    ap.add_argument("--pull-only", action="store_true", help="skip the push rows")
    ap.add_argument(
        "--baseline",
        metavar="REV",
        help="also pull with modelpack as of git revision REV (before/after in the same run)",
    )
    ap.add_argument("--workdir", help="where to put data (default: a temp dir, removed after)")
    args = ap.parse_args()

    size = parse_size(args.size)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="mp-bench-transfer-"))
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "CI": "1", "MODELPACK_UPLOAD_STATE_DIR": str(work / "upload-state")}
    # Installed packages start from compiled bytecode (pip compiles at install; modelpack-client's
    # .pyc files are in .venv-peers): so does modelpack here, from a private cache compiled now,
    # even where PYTHONDONTWRITEBYTECODE is set (it would recompile ~80 modules in every child).
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPYCACHEPREFIX"] = str(work / "pycache")
    sources = [str(ROOT / d) for d in ("modelpack", "mediatypes", "signing", "mount", "loader")]
    subprocess.run([sys.executable, "-m", "compileall", "-q", *sources], env=env, check=True)
    client_env = {**env, "DOCKER_CONFIG": str(work / "no-docker-config")}
    servers: list[RegistryServer] = []
    try:
        ckpt = work / "ckpt"
        print(f"generating a {size / 2**30:.2f} GiB checkpoint ({args.shards} shards) …", flush=True)
        write_checkpoint(str(ckpt), SyntheticSpec.for_size(size, args.shards))
        total = sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file())
        layout = work / "layout"
        packed = api.pack(str(ckpt), f"oci:{layout}:v1")
        digest = str(packed.artifact.digest)
        print(f"checkpoint: {total / 2**30:.2f} GiB in {len(packed.artifact.files)} files; {digest}")

        times: dict[str, list[float]] = {}
        peaks: dict[str, int] = {}

        def record(name: str, seconds: float, rss: int) -> None:
            times.setdefault(name, []).append(seconds)
            peaks[name] = max(rss, peaks.get(name, 0))

        def fresh_registry() -> RegistryServer:
            base = Path(tempfile.mkdtemp(prefix="registry-", dir=work))
            s = start_registry(base)
            servers.append(s)
            return s

        def retire(s: RegistryServer) -> None:
            s.stop()
            servers.remove(s)
            drop_dir(s.config_path.parent)

        jobs = ["-j", str(args.jobs), "--progress", "off"]
        pushes = [
            ("push modelpack (dir)", lambda ref: [*MODELPACK, "push", str(ckpt), ref, *jobs]),
            ("push modelpack (layout)", lambda ref: [*MODELPACK, "cp", f"oci:{layout}:v1", ref, *jobs]),
            (
                "push skopeo (layout)",
                lambda ref: [*SKOPEO, "--dest-tls-verify=false", f"oci:{layout}:v1", f"docker://{ref}"],
            ),
        ]
        layers: list[tuple[str, int]] = []
        pulls = [
            ("pull curl ceiling (4 ∥)", lambda s, dest: curl_ceiling(s.host, "bench/model", layers, dest)),
            (
                "pull curl|tee|sha256 (4 ∥)",
                lambda s, dest: verified_ceiling(s.host, "bench/model", layers, dest),
            ),
            (
                "pull modelpack (files)",
                lambda s, dest: [*MODELPACK, "pull", s.ref("bench/model", "v1"), str(dest), *jobs],
            ),
            (
                "pull modelpack (layout)",
                lambda s, dest: [*MODELPACK, "cp", s.ref("bench/model", "v1"), f"oci:{dest}:v1", *jobs],
            ),
            (
                "pull skopeo (layout)",
                lambda s, dest: [
                    *SKOPEO,
                    "--src-tls-verify=false",
                    f"docker://{s.ref('bench/model', 'v1')}",
                    f"oci:{dest}:v1",
                ],
            ),
        ]
        if args.baseline:
            base_env = {**env, "PYTHONPATH": baseline_tree(args.baseline, work / "baseline", env)}
            pulls.append(
                (
                    f"pull modelpack @{args.baseline[:10]}",
                    lambda s, dest: [*MODELPACK, "pull", s.ref("bench/model", "v1"), str(dest), *jobs],
                )
            )
        if PEERS_PYTHON.exists():
            pulls.append(
                (
                    "pull modelpack-client",
                    lambda s, dest: [*CLIENT, "pull", s.ref("bench/model", "v1"), str(dest)],
                )
            )
        else:
            print("modelpack-client row left out: .venv-peers is missing (make deps installs it)")
        # the image-shaped variant (a KServe modelcar) of the same checkpoint, side by side with
        # KServe's own fetch (issue 25 item 4)
        pulls.append(
            (
                "pull modelpack modelcar",
                lambda s, dest: [*MODELPACK, "pull", s.ref("bench/modelcar", "v1"), str(dest), *jobs],
            )
        )
        if peer_available():
            pulls.append(
                (
                    "pull kserve-storage modelcar",
                    lambda s, dest: kserve_storage(s.host, "bench/modelcar:v1", dest, client_env)[0],
                )
            )
        else:
            print("kserve-storage row left out: .venv-peers is missing (make deps installs it)")
        for r in range(args.rounds):
            # the order rotates each round so no tool always runs first
            if not args.pull_only:
                for name, make in pushes[r % 3 :] + pushes[: r % 3]:
                    s = fresh_registry()  # each push into a fresh, empty registry
                    t, rss = run_child(make(s.ref("bench/model", "v1")), env)
                    record(name, t, rss)
                    retire(s)
            s = fresh_registry()
            run_child([*MODELPACK, "push", str(ckpt), s.ref("bench/model", "v1"), *jobs], env)
            image = [*MODELPACK, "push", str(ckpt), s.ref("bench/modelcar", "v1"), "--format", "image", *jobs]
            run_child(image, env)
            layers = manifest_layers(s.host, "bench/model", "v1")
            n = len(pulls)
            for name, make_pull in pulls[r % n :] + pulls[: r % n]:
                dest = work / "pulled"
                drop_dir(dest)
                cmd = make_pull(s, dest)
                if name.startswith("pull modelpack @"):  # `python -c` puts its cwd first on sys.path
                    t, rss = run_child(cmd, base_env, cwd=base_env["PYTHONPATH"])
                elif name.startswith("pull kserve-storage"):
                    t, rss = run_child(cmd, {**client_env, "KSERVE_OCI_INSECURE_REGISTRY": "true"})
                else:
                    t, rss = run_child(cmd, client_env, tree=name.startswith("pull curl"))
                record(name, t, rss)
                drop_dir(dest)
            retire(s)

        load = os.getloadavg()
        print()
        print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; {args.rounds} rounds")
        print(f"{'transfer':<30}{'best s':>8}{'median':>8}{'GB/s':>7}{'vs peer':>9}{'peak RSS':>11}")
        for name, ts in times.items():
            best = min(ts)
            peer = "push skopeo (layout)" if name.startswith("push") else "pull curl ceiling (4 ∥)"
            if name == "pull modelpack modelcar" and "pull kserve-storage modelcar" in times:
                peer = "pull kserve-storage modelcar"
            ratio = min(times[peer]) / best
            print(
                f"{name:<30}{best:>8.2f}{statistics.median(ts):>8.2f}{total / best / 1e9:>7.2f}"
                f"{ratio:>8.2f}x{peaks[name] / 2**20:>8.0f} MiB"
            )
        print(
            "\nvs peer = the peer's best seconds / this row's best (push: skopeo; pull: the curl ceiling;"
            " pull modelpack modelcar: kserve-storage on the same modelcar)"
        )
        verified = min(times["pull curl|tee|sha256 (4 ∥)"])
        print(
            f"pull modelpack (files) vs the verifying ceiling: {verified / min(times['pull modelpack (files)']):.2f}x"
        )
        if "pull kserve-storage modelcar" in times:
            ratios = [
                k / m
                for k, m in zip(
                    times["pull kserve-storage modelcar"], times["pull modelpack modelcar"], strict=True
                )
            ]
            print(
                f"pull modelpack modelcar vs kserve-storage, same modelcar, same registry, per round: "
                f"median {statistics.median(ratios):.2f}x ({PEER_CAVEAT})"
            )
        print("pull modelpack (files) vs pull modelpack-client: ", end="")
        if "pull modelpack-client" in times:
            print(f"{min(times['pull modelpack-client']) / min(times['pull modelpack (files)']):.2f}x")
        else:
            print("n/a")
    finally:
        for s in servers:
            s.stop()
        if not args.workdir:
            drop_dir(work)


if __name__ == "__main__":
    main()
