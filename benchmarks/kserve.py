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

Runs are interleaved (each run: every contender once, the order rotated), so a ratio compares
processes that saw the same load; the load average is printed; ``os.sync()`` runs, untimed,
before each process. ``--layers 2`` packs all weight files into one layer, as a modelcar built
by ``COPY models/ /models/`` has them (extraction, not the parallel layers, is then what
counts). Reported: wall time (median, and each run's with its CPU seconds: on the 2-core VM a
run is sometimes ~0.6 s slower with ~0.9 s more CPU in the contender's own process), the
median per-run ratio to kserve-storage, CPU seconds (user + system), peak RSS of the process (``wait4`` in a small launcher:
its own high-water mark, not this benchmark's), blob bytes the registry sent
(its access log), and the corruption outcome: one byte flipped in a weight layer's blob in the
registry's storage, then each contender's exit code and whether DEST holds a wrong file.

    python benchmarks/kserve.py                    # 512 MiB model, 3 runs
    python benchmarks/kserve.py --size 2GiB --runs 5 --json /tmp/kserve.json
    python benchmarks/kserve.py --baseline 5a68ddb      # before/after rows in the same runs
    python benchmarks/kserve.py --files 32 --layers 2   # one layer of 32 weight files
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
sys.path.insert(0, str(ROOT / "benchmarks"))

from modelcar_peer import PEER_CAVEAT, kserve_storage, make_model, modelpack_initializer  # noqa: E402

from modelpack.api import transfer  # noqa: E402
from modelpack.cli import parse_size  # noqa: E402
from tests.fixtures.registry import RegistryServer, start_registry  # noqa: E402

_BLOB_LINE = re.compile(r'"GET /v2/[^ ]*/blobs/sha256:[0-9a-f]{64} HTTP/[0-9.]+" (\d{3}) (\d+)')
# runs argv[1:] and writes its exit code and its own peak RSS (wait4's ru_maxrss, KiB) to stderr's
# last line: started from this small process, the contender's high-water mark is its own
_LAUNCH = (
    "import os, subprocess, sys\n"
    "p = subprocess.Popen(sys.argv[1:])\n"
    "_, status, usage = os.wait4(p.pid, 0)\n"
    "sys.stderr.write(f'\\nmaxrss-kib: {usage.ru_maxrss} cpu-s: {usage.ru_utime + usage.ru_stime:.3f}')\n"
    "sys.exit(os.waitstatus_to_exitcode(status))\n"
)


def blob_bytes(server: RegistryServer, mark: int) -> int:
    return sum(int(m.group(2)) for line in server.access_log()[mark:] if (m := _BLOB_LINE.search(line)))


def run_contender(
    name: str, uri_host: str, repo: str, dest: Path, work: Path, jobs: int, baseline: str | None = None
) -> dict[str, Any]:
    """One process; its wall time, peak RSS (KiB → MiB), exit code and stderr tail. A name
    ending in ``@before`` runs modelpack from the ``baseline`` tree (PYTHONPATH)."""
    base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(work / "home")}
    if name.endswith("@before"):
        assert baseline is not None
        base["PYTHONPATH"] = baseline
        name = name.removesuffix("@before")
    if name == "kserve-storage":
        argv, env = kserve_storage(uri_host, repo, dest, base)
    else:
        cache = work / "cache" if name == "modelpack+cache" else None
        if cache is not None:
            shutil.rmtree(cache, ignore_errors=True)
        argv, env = modelpack_initializer(uri_host, repo, dest, base, jobs=jobs, cache=cache)
    # untimed, as transfer.py does: whoever runs next must not pay for the last one's dirty pages
    # (kserve-storage leaves its whole model unsynced; a writer after it is throttled)
    os.sync()
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", _LAUNCH, *argv],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        check=False,
    )
    wall = time.perf_counter() - t0
    err, _, tail = proc.stderr.decode(errors="replace").rpartition("\nmaxrss-kib: ")
    rss, _, cpu = tail.partition(" cpu-s: ")
    return {
        "wall_s": wall,
        "cpu_s": float(cpu) if cpu else 0.0,
        "rss_mib": int(rss) / 1024 if rss.strip().isdigit() else 0.0,
        "rc": proc.returncode,
        "stderr": err.strip().splitlines()[-1:] if err.strip() else [],
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
    ap.add_argument("--files", type=int, default=4, help="weight files the model is split into (default 4)")
    ap.add_argument(
        "--layers",
        type=int,
        default=None,
        help="at most this many image layers (2: the small files and all weights in one, as a "
        "modelcar built by COPY models/ /models/ has them); default one per weight file",
    )
    ap.add_argument(
        "--baseline",
        metavar="REV",
        help="also run modelpack and modelpack+cache as of git revision REV (rows NAME@before), interleaved",
    )
    args = ap.parse_args()
    contenders = args.contenders.split(",")
    work = Path(tempfile.mkdtemp(prefix="mp-bench-kserve-"))
    baseline = None
    if args.baseline:
        from transfer import baseline_tree  # the same before-tree layout as transfer.py's --baseline

        baseline = baseline_tree(args.baseline, work / "baseline", dict(os.environ))
        contenders += [f"{n}@before" for n in contenders if n in ("modelpack", "modelpack+cache")]
    server = start_registry(work / "registry")
    try:
        expected = make_model(work / "model", parse_size(args.size), files=args.files)
        repo = "bench/modelcar:v1"
        if args.layers is not None:  # image_format groups consecutive weight files past this
            from modelpack.packing import image_format

            defaults = image_format.build_image_artifact.__kwdefaults__
            assert defaults is not None
            defaults["max_layers"] = args.layers
        transfer.push(str(work / "model"), f"{server.host}/{repo}", format="image", progress="off")
        raw_repo = "bench/raw:v1"
        transfer.push(str(work / "model"), f"{server.host}/{raw_repo}", progress="off")
        results: dict[str, Any] = {"size": args.size, "runs": args.runs, "contenders": {}}
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in contenders}
        for i in range(args.runs):  # interleaved: every contender once per run, the order rotated
            for name in contenders[i % len(contenders) :] + contenders[: i % len(contenders)]:
                dest = work / f"dest-{name}-{i}"
                mark = server.log_mark()
                r = run_contender(
                    name,
                    server.host,
                    raw_repo if name == "modelpack-raw" else repo,
                    dest,
                    work,
                    args.jobs,
                    baseline,
                )
                r["blob_bytes"] = blob_bytes(server, mark)
                r["dest"] = dest_state(dest, expected)
                r["load1"] = os.getloadavg()[0]
                runs[name].append(r)
                shutil.rmtree(dest, ignore_errors=True)
        for name in contenders:
            rs = runs[name]
            results["contenders"][name] = {
                "wall_s_median": statistics.median(r["wall_s"] for r in rs),
                "wall_s": [round(r["wall_s"], 3) for r in rs],
                "cpu_s_median": statistics.median(r["cpu_s"] for r in rs),
                "rss_mib_max": max(r["rss_mib"] for r in rs),
                "blob_bytes": rs[-1]["blob_bytes"],
                "rc": [r["rc"] for r in rs],
                "dest": rs[-1]["dest"],
            }
        if "kserve-storage" in runs:  # per-run ratios: each run's pair saw the same load
            for name in contenders:
                results["contenders"][name]["vs_kserve_median"] = statistics.median(
                    k["wall_s"] / r["wall_s"] for k, r in zip(runs["kserve-storage"], runs[name], strict=True)
                )
        results["load_average"] = [round(x, 2) for x in os.getloadavg()]
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
            r = run_contender(name, server.host, repo, dest, work, args.jobs, baseline)
            results["contenders"][name]["corruption"] = {
                "rc": r["rc"],
                "dest": dest_state(dest, expected),
                "stderr": r["stderr"],
            }
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)

    load = results["load_average"]
    layers = f"at most {args.layers} layers" if args.layers else "one layer per weight file"
    print(
        f"model {args.size} (modelcar, {len(expected)} files, {layers}), {args.runs} runs interleaved, "
        "loopback registry, "
        f"load average {load[0]} {load[1]} {load[2]}"
    )
    print(
        f"{'contender':<24}{'wall (median)':>14}{'vs kserve':>10}{'CPU s':>7}{'peak RSS':>11}{'blob bytes':>14}"
        "   corrupted blob in the registry"
    )
    for name, r in results["contenders"].items():
        c = r["corruption"]
        ratio = r.get("vs_kserve_median")
        shown = f"{ratio:>9.2f}x" if ratio is not None else f"{'-':>10}"
        print(
            f"{name:<24}{r['wall_s_median']:>12.2f} s{shown}{r['cpu_s_median']:>7.2f}{r['rss_mib_max']:>7.0f} MiB"
            f"{r['blob_bytes'] / 2**20:>10.1f} MiB   exit {c['rc']}, DEST: {c['dest']}"
        )
    for name, r in results["contenders"].items():
        per_run = ", ".join(f"{w:.2f}" for w in r["wall_s"])
        print(f"  {name}: each run {per_run} s")
    print(
        f"vs kserve = median over runs of kserve-storage's seconds / the row's (> 1: faster). {PEER_CAVEAT}."
    )
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
