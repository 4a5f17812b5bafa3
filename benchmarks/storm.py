"""Release storm on simulated nodes (issue 23 item 4): N nodes pull one model at the same moment.

Each node is its own network namespace with its own node cache and a veth link rate-limited in
both directions (``tc tbf``, ``--rate`` Mbit/s); the origin registry (Debian ``docker-registry``)
sits in its own namespace with ``--origin-factor`` × that egress; all are joined by a bridge in a
namespace of the benchmark's own. Modes, like for like at each N (same model, links, caches cold):

- ``direct``: every node pulls from the origin;
- ``mirror``: every node pulls through one pull-through mirror (``docker-registry`` with
  ``proxy.remoteurl``, its own namespace and the origin's link), cold at the start of the run;
- ``peers``: every node runs ``cache serve --fill ORIGIN/REPO@DIGEST`` and pulls with
  ``--mirror dns+http://peers.storm:5050`` (the name resolves to every node, as a headless
  Service does) and ``MODELPACK_PEER_ORDER=blob``: each blob is asked first of its owner
  (rendezvous with bounded load, ``owners.balanced_owners``), which fetches it once from the
  origin and streams it on as it arrives; the origin is last.

Per run: origin egress (tx bytes of the origin's veth), duplicate bytes (what the nodes' veths
received beyond one model each: protocol overhead, re-fetches), p50/p95 completion (process start
to exit), mirror abandonments (``registry.mirror_abandoned`` in each cache's events), failures,
and whether every file of every node's snapshot hashes to the source file's sha256. Two more
runs at the largest N: ``peers-kill`` (the owner of the largest blob has its ``cache serve``
SIGKILLed once it has sent 1 MiB) and ``peers-corrupt`` (one more peer, in the DNS name, whose
store holds every blob of the model with zeroed bytes, committed as if genuine).

The benchmark creates and removes every namespace, veth, bridge, ``/etc/netns/<ns>`` directory and
process itself (names ``mpstorm-<pid>-…``, addresses in 10.231.0.0/24 only), and exits with a
message naming why when it is not root or ``ip netns`` fails. A table on stdout, JSON and a PNG in
``--out``.

    sudo .venv/bin/python benchmarks/storm.py                       # N = 1 2 4 8 16, 64 MiB
    sudo .venv/bin/python benchmarks/storm.py --nodes 2 --size 8MiB --modes direct,peers --no-faults
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SUBNET = "10.231.0"
#: the peers' ``cache serve`` token (``MODELPACK_SERVE_TOKEN``) and the nodes' ``MODELPACK_PEER_TOKEN``
STORM_PEER_TOKEN = "storm-peer-token"
ORIGIN_IP = f"{SUBNET}.1"
MIRROR_IP = f"{SUBNET}.2"
PEER_PORT = 5050
PEERS_NAME = "peers.storm"
REPO = "storm/model"
REGISTRY_BIN = "/usr/bin/docker-registry"
MODELPACK = [sys.executable, "-m", "modelpack.cli"]


def node_ip(i: int) -> str:
    return f"{SUBNET}.{10 + i}"


class Unavailable(Exception):
    """The environment cannot run the storm (not root, no ip netns, no registry binary)."""


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if check and res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {res.stderr.strip() or res.stdout.strip()}")
    return res


# ---------------------------------------------------------------------------------------- network
class Network:
    """A bridge namespace plus one namespace per host, each with a rate-limited veth to the bridge.
    Everything it makes is recorded and removed by ``close`` (deleting a namespace removes its
    veth ends; the bridge goes with its namespace)."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.bridge_ns = f"{tag}-br"
        self.namespaces: list[str] = []
        self.etc_dirs: list[Path] = []
        self.procs: list[subprocess.Popen[Any]] = []
        self._ports = 0
        try:
            self._add_ns(self.bridge_ns)
            _run("ip", "-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", self.bridge_ns, "link", "set", "br0", "up")
        except BaseException:
            self.close()
            raise

    def _add_ns(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self.namespaces.append(name)
        _run("ip", "-n", name, "link", "set", "lo", "up")

    def add_host(self, name: str, ip: str, rate_mbit: float, ingress_mbit: float | None = None) -> str:
        """A namespace ``<tag>-<name>`` at ``ip`` whose link sends at ``rate_mbit`` and receives
        at ``ingress_mbit`` (default the same)."""
        ns = f"{self.tag}-{name}"
        self._add_ns(ns)
        self._ports += 1
        port = f"v{self._ports}"
        _run(
            "ip",
            "-n",
            self.bridge_ns,
            "link",
            "add",
            port,
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            ns,
        )
        _run("ip", "-n", self.bridge_ns, "link", "set", port, "master", "br0", "up")
        _run("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
        _run("ip", "-n", ns, "link", "set", "eth0", "up")
        _shape(ns, "eth0", rate_mbit)  # what the host sends
        _shape(self.bridge_ns, port, ingress_mbit or rate_mbit)  # what the bridge sends it
        return ns

    def hosts_file(self, ns: str, lines: list[str]) -> None:
        """``ip netns exec`` bind-mounts ``/etc/netns/<ns>/hosts`` over ``/etc/hosts``."""
        d = Path("/etc/netns") / ns
        d.mkdir(parents=True, exist_ok=True)
        if d not in self.etc_dirs:
            self.etc_dirs.append(d)
        (d / "hosts").write_text("127.0.0.1 localhost\n" + "".join(f"{x}\n" for x in lines))

    def popen(self, ns: str, cmd: list[str], **kw: Any) -> subprocess.Popen[Any]:
        proc = subprocess.Popen(["ip", "netns", "exec", ns, *cmd], **kw)
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=10)
        for ns in reversed(self.namespaces):
            _run("ip", "netns", "del", ns, check=False)
        for d in self.etc_dirs:
            shutil.rmtree(d, ignore_errors=True)
        self.namespaces.clear()


def _shape(ns: str, dev: str, mbit: float) -> None:
    burst = max(64 * 1024, int(mbit * 1e6 / 8 / 100))  # 10 ms of traffic, at least 64 KiB
    if shutil.which("ethtool"):  # segmentation offload would let tbf see 64 KiB packets
        _run("ip", "netns", "exec", ns, "ethtool", "-K", dev, "tso", "off", "gso", "off", check=False)
    _run(
        "tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "tbf",
        "rate", f"{mbit}mbit", "burst", str(burst), "latency", "100ms",
    )  # fmt: skip
    # flows share the shaped link fairly (fq_codel, Linux's default qdisc), as on a real NIC: a
    # plain tbf FIFO starves some of an owner's many flows below any throughput floor
    _run("tc", "-n", ns, "qdisc", "add", "dev", dev, "parent", "1:1", "fq_codel", check=False)


def counters(ns: str) -> tuple[int, int]:
    """(rx bytes, tx bytes) of ``eth0`` in ``ns``."""
    out = _run("ip", "-n", ns, "-s", "-j", "link", "show", "eth0").stdout
    stats = json.loads(out)[0]["stats64"]
    return int(stats["rx"]["bytes"]), int(stats["tx"]["bytes"])


def cpu_busy() -> tuple[float, float]:
    """(busy jiffies, total jiffies) from /proc/stat: the machine's CPU use over a run."""
    fields = [float(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields)


# ---------------------------------------------------------------------------------------- services
def registry_config(path: Path, storage: Path, proxy_remote: str | None = None) -> None:
    lines = [
        "version: 0.1",
        "log:",
        "  level: warn",
        "  accesslog:",
        "    disabled: true",
        "storage:",
        "  filesystem:",
        f"    rootdirectory: {storage}",
        "http:",
        "  addr: 0.0.0.0:5000",
        f"  secret: {os.urandom(8).hex()}",
    ]
    if proxy_remote:
        lines += ["proxy:", f"  remoteurl: {proxy_remote}"]
    path.write_text("\n".join(lines) + "\n")


def start_registry(
    net: Network, ns: str, base: Path, proxy_remote: str | None = None
) -> subprocess.Popen[Any]:
    base.mkdir(parents=True, exist_ok=True)
    registry_config(base / "config.yml", base / "storage", proxy_remote)
    log = open(base / "registry.log", "ab")
    proc = net.popen(
        ns,
        [REGISTRY_BIN, "serve", str(base / "config.yml")],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env={"PATH": "/usr/bin:/bin", "HOME": str(base)},
    )
    log.close()
    _wait_http(ns, "127.0.0.1:5000", proc, base / "registry.log")
    return proc


def _wait_http(ns: str, hostport: str, proc: subprocess.Popen[Any], log: Path, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{hostport} exited: {log.read_text(errors='replace')[-2000:]}")
        res = _run(
            "ip", "netns", "exec", ns, "curl", "-s", "-o", "/dev/null", "-w", "%{http_code}",
            f"http://{hostport}/v2/", check=False,
        )  # fmt: skip
        if res.stdout.strip() in ("200", "401"):
            return
        time.sleep(0.1)
    raise RuntimeError(f"{hostport} in {ns} did not answer /v2/ within {timeout:g} s")


def new_cache(path: Path) -> None:
    from modelpack.mount.store import Store

    Store(str(path))


def start_cache_serve(
    net: Network, ns: str, cache: Path, ip: str, pinned: str, log: Path
) -> subprocess.Popen[Any]:
    out = open(log, "ab")
    proc = net.popen(
        ns,
        [
            *MODELPACK, "cache", "serve", "--cache", str(cache), "--listen", f"{ip}:{PEER_PORT}",
            "--fill", pinned, "--fill-plain-http", "--fill-concurrency", "16", "--max-connections", "256",
        ],
        stdout=subprocess.DEVNULL,
        stderr=out,
        stdin=subprocess.DEVNULL,
        env=_env(),
    )  # fmt: skip
    out.close()
    return proc


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MODELPACK_")}
    env.update(
        PYTHONPATH=str(ROOT), MODELPACK_HOSTS_DIR="/nonexistent-storm-hosts", CI="1", MODELPACK_LOG="info"
    )
    # peers listen beyond loopback, so they need a token; the pulling nodes present the same one
    env.update(MODELPACK_SERVE_TOKEN=STORM_PEER_TOKEN, MODELPACK_PEER_TOKEN=STORM_PEER_TOKEN)
    env.update(extra)
    return env


# ---------------------------------------------------------------------------------------- model
@dataclass
class Model:
    digest: str
    size: int  # bytes of all blobs (config, layers) — what one node must receive
    files: dict[str, str]  # relative path → sha256 hex of the source file
    blobs: dict[str, int]  # layer digest → size
    config: tuple[str, int] = ("", 0)  # the config blob (digest, size): owners are planned with it


def make_model(base: Path, size: int, shards: int) -> Path:
    from modelpack.testdata.synthetic import SyntheticSpec, write_checkpoint

    ckpt = base / "ckpt"
    big = size >= 32 * 1024 * 1024  # else a tiny model for the harness's own test
    hidden, inter, vocab = (512, 1376, 4096) if big else (128, 344, 256)
    per_layer = (4 * hidden * hidden + 3 * hidden * inter) * 2  # BF16
    layers = max(shards, round((size - 2 * vocab * hidden * 2) / per_layer))
    spec = SyntheticSpec(hidden=hidden, intermediate=inter, layers=layers, vocab=vocab, shards=shards)
    write_checkpoint(str(ckpt), spec)
    return ckpt


def push_model(net: Network, origin_ns: str, ckpt: Path) -> Model:
    """Push from inside the origin's namespace (over its loopback: no counted traffic)."""
    res = subprocess.run(
        [
            "ip",
            "netns",
            "exec",
            origin_ns,
            *MODELPACK,
            "push",
            str(ckpt),
            f"127.0.0.1:5000/{REPO}:v1",
            "--json",
        ],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=300,
    )
    if res.returncode != 0:
        raise RuntimeError(f"push failed: {res.stderr[-2000:]}")
    digest = json.loads(res.stdout)["digest"]
    raw = subprocess.run(
        ["ip", "netns", "exec", origin_ns, "curl", "-s", "-H",
         "Accept: application/vnd.oci.image.manifest.v1+json",
         f"http://127.0.0.1:5000/v2/{REPO}/manifests/{digest}"],
        capture_output=True, timeout=30, check=True,
    ).stdout  # fmt: skip
    assert "sha256:" + hashlib.sha256(raw).hexdigest() == digest
    doc = json.loads(raw)
    blobs = {d["digest"]: int(d["size"]) for d in doc["layers"]}
    size = sum(blobs.values()) + int(doc["config"]["size"]) + len(raw)
    files = {
        str(p.relative_to(ckpt)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in ckpt.rglob("*")
        if p.is_file()
    }
    return Model(digest, size, files, blobs, (doc["config"]["digest"], int(doc["config"]["size"])))


# ---------------------------------------------------------------------------------------- runs
@dataclass
class Run:
    mode: str
    nodes: int
    seconds: list[float] = field(default_factory=list)
    failed: int = 0
    verified: int = 0
    origin_tx: int = 0
    mirror_tx: int = 0
    node_rx: int = 0
    abandoned: int = 0
    mismatches: int = 0
    cpu_busy: float = 0.0  # the whole machine's CPU use during the run (others' work included)
    pull_cpu_s: float = 0.0  # CPU seconds the N pull processes used
    wall: float = 0.0
    errors: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def row(self, model: Model) -> dict[str, Any]:
        secs = sorted(self.seconds) or [float("nan")]
        return {
            "mode": self.mode,
            "nodes": self.nodes,
            "p50_s": round(statistics.median(secs), 2),
            "p95_s": round(_p95(secs), 2),
            "origin_egress_bytes": self.origin_tx,
            "origin_egress_x_model": round(self.origin_tx / model.size, 2),
            "mirror_egress_bytes": self.mirror_tx,
            "node_rx_bytes": self.node_rx,
            "duplicate_bytes": max(0, self.node_rx - self.nodes * model.size),
            "duplicate_x_model": round(max(0, self.node_rx - self.nodes * model.size) / model.size, 2),
            "abandoned": self.abandoned,
            "digest_mismatches": self.mismatches,
            "failed": self.failed,
            "verified": self.verified,
            "cpu_busy_pct": round(100 * self.cpu_busy, 1),
            "pull_cpu_s": round(self.pull_cpu_s, 2),
            "wall_s": round(self.wall, 2),
            **self.extra,
        }


def _p95(values: list[float]) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=20, method="inclusive")[18]


class Storm:
    def __init__(self, args: argparse.Namespace, base: Path, net: Network) -> None:
        self.args = args
        self.base = base
        self.net = net
        rate = args.rate
        self.origin_ns = self.net.add_host("o", ORIGIN_IP, rate * args.origin_factor)
        self.mirror_ns = self.net.add_host("m", MIRROR_IP, rate * args.origin_factor)
        n = max(args.nodes)
        self.node_ns = [self.net.add_host(f"n{i}", node_ip(i), rate) for i in range(n)]
        start_registry(self.net, self.origin_ns, base / "origin")
        self.model = push_model(self.net, self.origin_ns, make_model(base, args.size, args.shards))
        self.pinned = f"{ORIGIN_IP}:5000/{REPO}@{self.model.digest}"
        self.evil_ip = self._evil_address([node_ip(i) for i in range(n)])
        self.evil_ns = self.net.add_host("x", self.evil_ip, rate)

    # ----------------------------------------------------------------------------- one storm
    def run(self, mode: str, n: int) -> Run:
        run = Run(mode, n)
        work = self.base / f"{mode}-{n}"
        work.mkdir()
        nodes = list(range(n))
        serves: dict[int, subprocess.Popen[Any]] = {}
        mirror_proc = None
        extra_env: dict[str, str] = {}
        mirror_args: list[str] = []
        if mode == "mirror":
            mirror_proc = start_registry(
                self.net, self.mirror_ns, work / "mirror", f"http://{ORIGIN_IP}:5000"
            )
            mirror_args = ["--mirror", f"http://{MIRROR_IP}:5000"]
        if mode.startswith("peers"):
            peer_ips = [node_ip(i) for i in nodes] + ([self.evil_ip] if mode == "peers-corrupt" else [])
            for i in nodes:
                self.net.hosts_file(self.node_ns[i], [f"{ip} {PEERS_NAME}" for ip in peer_ips])
            for i in nodes:
                new_cache(work / f"node-{i}")
                serves[i] = start_cache_serve(
                    self.net,
                    self.node_ns[i],
                    work / f"node-{i}",
                    node_ip(i),
                    self.pinned,
                    work / f"serve-{i}.log",
                )
            if mode == "peers-corrupt":
                serves[-1] = self._corrupt_peer(work)
                run.extra["corrupt_peer_owns"] = self.evil_owns
            for i, proc in serves.items():
                ip = self.evil_ip if i == -1 else node_ip(i)
                ns = self.evil_ns if i == -1 else self.node_ns[i]
                _wait_http(ns, f"{ip}:{PEER_PORT}", proc, work / f"serve-{i}.log")
            mirror_args = ["--mirror", f"dns+http://{PEERS_NAME}:{PEER_PORT}"]
            extra_env = {"MODELPACK_PEER_ORDER": "blob"}
        before = {i: counters(self.node_ns[i]) for i in nodes}
        origin0 = counters(self.origin_ns)[1]
        mirror0 = counters(self.mirror_ns)[1]
        cpu0 = cpu_busy()
        own0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        killer = None
        if mode == "peers-kill":
            killer = self._killer(serves, nodes, run)
        procs: dict[int, subprocess.Popen[str]] = {}
        t0 = time.monotonic()
        for i in nodes:
            procs[i] = self.net.popen(
                self.node_ns[i],
                [
                    *MODELPACK, "pull", "--cache", str(work / f"node-{i}"), "--plain-http",
                    "--retry-for", "60s", "--jobs", str(self.args.jobs), *mirror_args, self.pinned,
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=_env(
                    MODELPACK_NODE_NAME=f"node-{i}",
                    MODELPACK_MIRROR_MIN_RATE=str(self.args.mirror_floor),
                    **extra_env,
                ),
            )  # fmt: skip
        outputs: dict[int, tuple[str, str]] = {}
        waiters = [
            threading.Thread(target=self._wait, args=(i, p, t0, run, outputs)) for i, p in procs.items()
        ]
        for t in waiters:
            t.start()
        for t in waiters:
            t.join()
        run.wall = time.monotonic() - t0
        cpu1 = cpu_busy()
        run.cpu_busy = (cpu1[0] - cpu0[0]) / max(1.0, cpu1[1] - cpu0[1])
        own1 = resource.getrusage(resource.RUSAGE_CHILDREN)  # the pulls (waited for by now)
        run.pull_cpu_s = (own1.ru_utime + own1.ru_stime) - (own0.ru_utime + own0.ru_stime)
        if killer is not None:
            killer.join(timeout=1)
        run.origin_tx = counters(self.origin_ns)[1] - origin0
        run.mirror_tx = counters(self.mirror_ns)[1] - mirror0
        run.node_rx = sum(counters(self.node_ns[i])[0] - before[i][0] for i in nodes)
        for i in nodes:
            out, err = outputs[i]
            if procs[i].returncode != 0:
                run.failed += 1
                run.errors.append(f"node-{i}: {err.strip()[-400:]}")
                continue
            if self._verified(out):
                run.verified += 1
            else:
                run.errors.append(f"node-{i}: snapshot does not match the source files")
            self._count_events(work / f"node-{i}" / "events.jsonl", run)
        for proc in serves.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in serves.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        if mirror_proc is not None:
            mirror_proc.terminate()
            mirror_proc.wait(timeout=10)
        if not self.args.keep:
            shutil.rmtree(work, ignore_errors=True)
        return run

    def _wait(
        self, i: int, proc: subprocess.Popen[str], t0: float, run: Run, outputs: dict[int, tuple[str, str]]
    ) -> None:
        out, err = proc.communicate(timeout=self.args.timeout)
        if proc.returncode == 0:
            run.seconds.append(time.monotonic() - t0)
        outputs[i] = (out, err)

    def _verified(self, stdout: str) -> bool:
        """Every file of the snapshot hashes to the source file's sha256, and no file is missing."""
        lines = stdout.strip().splitlines()
        if not lines:
            return False
        snap = Path(lines[-1].strip())
        got = {str(p.relative_to(snap)): p for p in snap.rglob("*") if p.is_file()}
        if set(got) != set(self.model.files):
            return False
        return all(hashlib.sha256(got[k].read_bytes()).hexdigest() == v for k, v in self.model.files.items())

    @staticmethod
    def _count_events(path: Path, run: Run) -> None:
        if not path.exists():
            return
        for line in path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                ev = json.loads(line)
                if ev.get("event") == "registry.mirror_abandoned":
                    run.abandoned += 1
                    why = re.sub(r"sha256:[0-9a-f]{64}|[0-9.]+:\\d+", "…", str(ev.get("reason", "")))[:90]
                    reasons = run.extra.setdefault("abandon_reasons", {})
                    reasons[why] = reasons.get(why, 0) + 1
                    if "digest mismatch" in str(ev.get("reason", "")):
                        run.mismatches += 1

    def _owners(self, ips: list[str]) -> dict[str, str]:
        """Blob digest → owner IP, as every pulling node plans it (``owners.balanced_owners``)."""
        from modelpack.oci.descriptor import Descriptor
        from modelpack.oci.digest import Digest
        from modelpack.targets.registry.owners import balanced_owners

        sizes = {**self.model.blobs, self.model.config[0]: self.model.config[1]}
        descs = [Descriptor("application/octet-stream", Digest(d), n) for d, n in sizes.items() if d]
        owners = balanced_owners([f"{ip}:{PEER_PORT}" for ip in ips], descs)
        return {d: o.rsplit(":", 1)[0] for d, o in owners.items()}

    def _owner(self, digest: str, ips: list[str]) -> str:
        return self._owners(ips)[digest]

    def _killer(
        self, serves: dict[int, subprocess.Popen[Any]], nodes: list[int], run: Run
    ) -> threading.Thread:
        """SIGKILL the ``cache serve`` that owns the largest blob once it has sent 1 MiB."""
        largest = max(self.model.blobs, key=lambda d: self.model.blobs[d])
        victim_ip = self._owner(largest, [node_ip(i) for i in nodes])
        victim = next(i for i in nodes if node_ip(i) == victim_ip)
        tx0 = counters(self.node_ns[victim])[1]

        def watch() -> None:
            deadline = time.monotonic() + self.args.timeout
            while time.monotonic() < deadline:
                if counters(self.node_ns[victim])[1] - tx0 >= 1024 * 1024:
                    serves[victim].kill()
                    run.extra["killed_peer"] = f"node-{victim} after {time.monotonic() - t_start:.2f} s"
                    return
                time.sleep(0.02)

        t_start = time.monotonic()
        t = threading.Thread(target=watch, daemon=True)
        t.start()
        return t

    def _evil_address(self, peers: list[str]) -> str:
        """An address for the corrupting peer that owns the most layers among ``peers`` + itself
        (the owners are deterministic: a peer that owns nothing would never be asked first)."""

        def owned(ip: str) -> int:
            owners = self._owners([*peers, ip])
            return sum(owners[d] == ip for d in self.model.blobs)

        best = max((f"{SUBNET}.{k}" for k in range(200, 250)), key=owned)
        self.evil_owns = owned(best)
        return best

    def _corrupt_peer(self, work: Path) -> subprocess.Popen[Any]:
        """A peer whose store holds every layer of the model with zeroed bytes, committed as a
        genuine blob would be (read-only, the cache owner's): only the digest can tell."""
        from modelpack.mount.modes import READ_ONLY_FILE_MODE
        from modelpack.mount.store import Store

        cache = work / "evil"
        store = Store(str(cache))
        for digest, size in self.model.blobs.items():
            # placed by hand: the blob writer (rightly) refuses to commit bytes that fail the digest
            tmp = Path(store.ingest_dir) / f"evil-{digest[7:23]}"
            with open(tmp, "wb") as f:
                f.truncate(size)
            os.chmod(tmp, READ_ONLY_FILE_MODE)
            os.replace(tmp, store.blob_path(digest))
        out = open(work / "serve--1.log", "ab")
        proc = self.net.popen(
            self.evil_ns,
            [*MODELPACK, "cache", "serve", "--cache", str(cache), "--listen", f"{self.evil_ip}:{PEER_PORT}"],
            stdout=subprocess.DEVNULL,
            stderr=out,
            stdin=subprocess.DEVNULL,
            env=_env(),
        )
        out.close()
        return proc


# ---------------------------------------------------------------------------------------- report
def table(rows: list[dict[str, Any]], model: Model) -> str:
    direct = {r["nodes"]: r for r in rows if r["mode"] == "direct"}
    head = (
        f"{'mode':<14}{'N':>3} {'p50 s':>7} {'p95 s':>7} {'p95/direct':>10} {'origin ×model':>13} "
        f"{'dup ×model':>10} {'abandoned':>9} {'bad digest':>10} {'failed':>6} {'verified':>8} {'CPU %':>6} {'pull CPU s':>10}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        d = direct.get(r["nodes"])
        ratio = f"{r['p95_s'] / d['p95_s']:.2f}" if d and d["p95_s"] else "-"
        lines.append(
            f"{r['mode']:<14}{r['nodes']:>3} {r['p50_s']:>7.2f} {r['p95_s']:>7.2f} {ratio:>10} "
            f"{r['origin_egress_x_model']:>13.2f} {r['duplicate_x_model']:>10.2f} {r['abandoned']:>9} "
            f"{r['digest_mismatches']:>10} {r['failed']:>6} {r['verified']:>5}/{r['nodes']:<2} "
            f"{r['cpu_busy_pct']:>6.1f} {r['pull_cpu_s']:>10.1f}"
        )
    lines.append(
        f"model: {model.size} bytes in {len(model.blobs)} layers; p95/direct compares with direct at the same N"
    )
    return "\n".join(lines)


def markdown(rows: list[dict[str, Any]]) -> str:
    """The table for docs/distribution.md (p95/direct against direct at the same N)."""
    direct = {r["nodes"]: r for r in rows if r["mode"] == "direct"}
    out = [
        "| mode | N | p50 s | p95 s | p95 / direct | origin egress × model | duplicate × model "
        "| abandoned | refused by digest | failed | verified |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        d = direct.get(r["nodes"])
        ratio = f"{r['p95_s'] / d['p95_s']:.2f}" if d and d["p95_s"] else "–"
        out.append(
            f"| {r['mode']} | {r['nodes']} | {r['p50_s']:.2f} | {r['p95_s']:.2f} | {ratio} "
            f"| {r['origin_egress_x_model']:.2f} | {r['duplicate_x_model']:.2f} | {r['abandoned']} "
            f"| {r['digest_mismatches']} | {r['failed']} | {r['verified']}/{r['nodes']} |"
        )
    return "\n".join(out) + "\n"


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for mode in ("direct", "mirror", "peers"):
        pts = sorted((r["nodes"], r) for r in rows if r["mode"] == mode)
        if not pts:
            continue
        xs = [n for n, _ in pts]
        a.plot(xs, [r["p95_s"] for _, r in pts], marker="o", label=mode)
        b.plot(xs, [r["origin_egress_x_model"] for _, r in pts], marker="o", label=mode)
    a.set(
        xlabel="nodes",
        ylabel="p95 completion (s)",
        title="p95 completion",
        xscale="log",
        xticks=[1, 2, 4, 8, 16],
    )
    b.set(
        xlabel="nodes",
        ylabel="origin egress (× model)",
        title="origin egress",
        xscale="log",
        xticks=[1, 2, 4, 8, 16],
    )
    for ax in (a, b):
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def check_environment() -> None:
    if os.geteuid() != 0:
        raise Unavailable("the storm needs root: it creates network namespaces, veths and tc qdiscs")
    if not os.path.exists(REGISTRY_BIN):
        raise Unavailable(f"{REGISTRY_BIN} (Debian docker-registry) is not installed")
    for tool in ("ip", "tc", "curl"):
        if shutil.which(tool) is None:
            raise Unavailable(f"{tool} is not installed")
    probe = f"mpstorm-{os.getpid()}-probe"
    res = _run("ip", "netns", "add", probe, check=False)
    if res.returncode != 0:
        raise Unavailable(f"ip netns add fails here: {res.stderr.strip()}")
    _run("ip", "netns", "del", probe, check=False)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from modelpack.cli import parse_size

    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--nodes", default="1,2,4,8,16", help="comma-separated node counts")
    p.add_argument("--modes", default="direct,mirror,peers", help="direct, mirror, peers")
    p.add_argument("--size", default="64MiB", type=parse_size, help="model size (default 64MiB)")
    p.add_argument("--shards", type=int, default=8, help="safetensors shards, one layer each (default 8)")
    p.add_argument("--rate", type=float, default=100.0, help="node link, Mbit/s each way (default 100)")
    p.add_argument(
        "--origin-factor", type=float, default=2.0, help="origin/mirror link × node link (default 2)"
    )
    p.add_argument(
        "--jobs", type=int, default=16, help="blobs each pull fetches at once, every mode (default 16: all)"
    )
    p.add_argument(
        "--mirror-floor",
        type=parse_size,
        default="32KiB",
        help="MODELPACK_MIRROR_MIN_RATE (bytes/s) for every pull (default 32KiB: a peer link that the "
        "whole storm shares gives each of its flows less than the 256 KiB/s default)",
    )
    p.add_argument("--no-faults", action="store_true", help="skip the peers-kill and peers-corrupt runs")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a node's pull may take")
    p.add_argument("--out", default=None, help="directory for storm.json and storm.png")
    p.add_argument("--keep", action="store_true", help="keep the node caches and logs")
    args = p.parse_args(argv)
    args.nodes = [int(x) for x in str(args.nodes).split(",") if x]
    args.modes = [x for x in args.modes.split(",") if x]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        check_environment()
    except Unavailable as exc:
        print(f"storm: skipped: {exc}", file=sys.stderr)
        return 77
    base = Path(tempfile.mkdtemp(prefix="mpstorm-"))
    net: Network | None = None
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        net = Network(f"mpstorm-{os.getpid()}")
        storm = Storm(args, base, net)
        rows = []
        for n in args.nodes:
            for mode in args.modes:
                run = storm.run(mode, n)
                rows.append(run.row(storm.model))
                print(json.dumps(rows[-1]), flush=True)
                for e in run.errors[:3]:
                    print("  " + e, file=sys.stderr)
        if not args.no_faults:
            n = max(args.nodes)
            for mode in ("peers-kill", "peers-corrupt"):
                run = storm.run(mode, n)
                rows.append(run.row(storm.model))
                print(json.dumps(rows[-1]), flush=True)
                for e in run.errors[:3]:
                    print("  " + e, file=sys.stderr)
        print()
        print(table(rows, storm.model))
        print(
            f"links: nodes {args.rate:g} Mbit/s each way, origin and mirror {args.rate * args.origin_factor:g} Mbit/s;"
            f" {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at the end"
        )
        if args.out:
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            (out / "storm.json").write_text(
                json.dumps({"model_bytes": storm.model.size, "rows": rows}, indent=1)
            )
            plot(rows, out / "storm.png")
            (out / "storm.md").write_text(markdown(rows))
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)
        if net is not None:
            net.close()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
