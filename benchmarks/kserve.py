"""KServe's storage initializer side by side (issue 26 item 4): ``kserve-storage`` vs ``modelpack``.

One modelcar (an OCI image whose layers hold the model under ``models/``, uncompressed tar, as
``modelpack push --format image`` writes it and KServe's ``oci+fetch`` reads it) in one loopback
registry. Each contender runs in its own process into a fresh DEST, ``--runs`` times:

- ``kserve-storage``: ``Storage.download_files(["oci://…"], [DEST])`` from the peers venv
  (``KSERVE_OCI_INSECURE_REGISTRY=true``), the call KServe's initializer entrypoint makes;
- ``modelpack``: ``modelpack storage-initializer modelpack://… DEST`` (``MODELPACK_PLAIN_HTTP=true``),
  verifying every layer; ``modelpack+cache``: the same through a cold node cache, then the copy
  into DEST;
- ``modelpack-raw`` (reference, not side by side): the same files as a raw ModelPack artifact
  (one layer per file, no tar), which kserve-storage cannot read.

Reported: wall time (median), peak RSS of the process (GNU ``time``), blob bytes the registry sent
(its access log), and the corruption outcome: one byte flipped in a weight layer's blob in the
registry's storage, then each contender's exit code and whether DEST holds a wrong file.

    python benchmarks/kserve.py                    # 512 MiB model, 3 runs
    python benchmarks/kserve.py --size 2GiB --runs 5 --json /tmp/kserve.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from modelpack.api import transfer  # noqa: E402
from modelpack.cli import parse_size  # noqa: E402
from tests.fixtures.registry import RegistryServer, start_registry  # noqa: E402

PEERS_PYTHON = ROOT / ".venv-peers" / "bin" / "python"
MODELPACK = ROOT / ".venv" / "bin" / "modelpack"
_BLOB_LINE = re.compile(r'"GET /v2/[^ ]*/blobs/sha256:[0-9a-f]{64} HTTP/[0-9.]+" (\d{3}) (\d+)')
KSERVE_SCRIPT = (
    "import sys; from kserve_storage import Storage; Storage.download_files([sys.argv[1]], [sys.argv[2]])"
)


def make_model(directory: Path, size: int, files: int = 4) -> dict[str, str]:
    """Random (incompressible) weight files plus a config; returns name → sha256."""
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps({"model_type": "benchmark", "files": files}))
    per = size // files
    for i in range(files):
        with open(directory / f"model-{i:05d}.bin", "wb") as f:
            left = per
            while left:
                n = min(left, 16 << 20)
                f.write(os.urandom(n))
                left -= n
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in directory.iterdir()}


def blob_bytes(server: RegistryServer, mark: int) -> int:
    return sum(int(m.group(2)) for line in server.access_log()[mark:] if (m := _BLOB_LINE.search(line)))


def run_contender(name: str, uri_host: str, repo: str, dest: Path, work: Path, jobs: int) -> dict[str, Any]:
    """One process; its wall time, peak RSS (KiB → MiB), exit code and stderr tail."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(work / "home")}
    if name == "kserve-storage":
        argv = [str(PEERS_PYTHON), "-c", KSERVE_SCRIPT, f"oci://{uri_host}/{repo}", str(dest)]
        env["KSERVE_OCI_INSECURE_REGISTRY"] = "true"
    else:
        argv = [str(MODELPACK), "storage-initializer", f"modelpack://{uri_host}/{repo}", str(dest)]
        env["MODELPACK_PLAIN_HTTP"] = "true"
        env["MODELPACK_PROGRESS_INTERVAL"] = "0"
        env["MODELPACK_JOBS"] = str(jobs)
        if name == "modelpack+cache":
            cache = work / "cache"
            shutil.rmtree(cache, ignore_errors=True)
            env["MODELPACK_CACHE"] = str(cache)
    # GNU time reports the contender's own peak RSS: a child forked from this process would
    # start with this process's high-water mark (Linux keeps maxrss across fork and exec)
    rss_file = work / "maxrss"
    t0 = time.perf_counter()
    proc = subprocess.run(
        ["/usr/bin/time", "-f", "%M", "-o", str(rss_file), *argv],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        check=False,
    )
    wall = time.perf_counter() - t0
    err = proc.stderr
    return {
        "wall_s": wall,
        "rss_mib": int(rss_file.read_text().split()[-1]) / 1024,
        "rc": proc.returncode,
        "stderr": err.decode(errors="replace").strip().splitlines()[-1:] if err else [],
    }


def dest_state(dest: Path, expected: dict[str, str]) -> str:
    got = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in dest.rglob("*") if p.is_file()}
    wrong = sorted(n for n, h in got.items() if expected.get(n) not in (None, h))
    if wrong:
        return f"WRONG FILE WRITTEN ({', '.join(wrong)})"
    return f"{len(got)} verified files" if got else "empty"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="512MiB", help="model size (default 512MiB)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=4, help="MODELPACK_JOBS: layers fetched at once (default 4)")
    ap.add_argument("--contenders", default="kserve-storage,modelpack,modelpack+cache,modelpack-raw")
    ap.add_argument("--json", dest="json_out", default=None, help="also write the results here")
    args = ap.parse_args()
    contenders = args.contenders.split(",")
    work = Path(tempfile.mkdtemp(prefix="mp-bench-kserve-"))
    server = start_registry(work / "registry")
    try:
        expected = make_model(work / "model", parse_size(args.size))
        repo = "bench/modelcar:v1"
        transfer.push(str(work / "model"), f"{server.host}/{repo}", format="image", progress="off")
        raw_repo = "bench/raw:v1"
        transfer.push(str(work / "model"), f"{server.host}/{raw_repo}", progress="off")
        results: dict[str, Any] = {"size": args.size, "runs": args.runs, "contenders": {}}
        for name in contenders:
            runs = []
            for i in range(args.runs):
                dest = work / f"dest-{name}-{i}"
                mark = server.log_mark()
                r = run_contender(
                    name, server.host, raw_repo if name == "modelpack-raw" else repo, dest, work, args.jobs
                )
                r["blob_bytes"] = blob_bytes(server, mark)
                r["dest"] = dest_state(dest, expected)
                runs.append(r)
                shutil.rmtree(dest, ignore_errors=True)
            results["contenders"][name] = {
                "wall_s_median": statistics.median(r["wall_s"] for r in runs),
                "rss_mib_max": max(r["rss_mib"] for r in runs),
                "blob_bytes": runs[-1]["blob_bytes"],
                "rc": [r["rc"] for r in runs],
                "dest": runs[-1]["dest"],
            }
        # corruption: flip one byte in the middle of the largest layer blob in the registry's storage
        manifest = json.loads(
            subprocess.run(
                [
                    "curl",
                    "-sf",
                    "-H",
                    "Accept: application/vnd.oci.image.manifest.v1+json",
                    f"{server.url}/v2/bench/modelcar/manifests/v1",
                ],
                check=True,
                capture_output=True,
            ).stdout
        )
        victim = max(manifest["layers"], key=lambda layer: layer["size"])["digest"]
        data = server.blob_data_path(victim)
        with open(data, "r+b") as f:
            f.seek(os.path.getsize(data) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x01]))
        results["corrupted_layer"] = victim
        for name in contenders:
            if name == "modelpack-raw":
                results["contenders"][name]["corruption"] = {
                    "rc": "-",
                    "dest": "not run (other artifact)",
                    "stderr": [],
                }
                continue
            dest = work / f"dest-{name}-corrupt"
            r = run_contender(name, server.host, repo, dest, work, args.jobs)
            results["contenders"][name]["corruption"] = {
                "rc": r["rc"],
                "dest": dest_state(dest, expected),
                "stderr": r["stderr"],
            }
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)

    print(f"model {args.size} (modelcar, {len(expected)} files), {args.runs} runs, loopback registry")
    print(
        f"{'contender':<18}{'wall (median)':>14}{'peak RSS':>11}{'blob bytes':>14}   corrupted blob in the registry"
    )
    for name, r in results["contenders"].items():
        c = r["corruption"]
        print(
            f"{name:<18}{r['wall_s_median']:>12.2f} s{r['rss_mib_max']:>7.0f} MiB{r['blob_bytes'] / 2**20:>10.1f} MiB"
            f"   exit {c['rc']}, DEST: {c['dest']}"
        )
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
