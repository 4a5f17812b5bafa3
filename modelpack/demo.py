"""The whole delivery chain on one machine, end to end: ``python -m modelpack.demo [--out DIR]``.

generate a tiny Llama (transformers, fixed seed, no hub download) → pack into an OCI layout →
push to a local registry with a signature (when Debian's docker-registry is installed; the
layout otherwise) → pull-and-verify into a node cache under a trust policy → load through the
streaming loader into a fresh model → t9 check (logits identical) → a cache-hit start and a
direct streaming start → `modelpack timeline` over the event log.

Needs torch (installed first, the build you use) and the `demo` extra
(``pip install 'modelpack-oci[demo]'``: transformers, numpy, safetensors). Everything lands
under ``--out`` (default ``./modelpack-demo``), which is emptied first. `make demo` runs it from
the checkout into examples/generated/ (examples/demo.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REGISTRY_BIN = "/usr/bin/docker-registry"


def step(title: str) -> None:
    print(f"\n=== {title}", flush=True)


def run(*args: str, env: dict[str, str] | None = None, show: bool = True) -> str:
    print("$ modelpack " + " ".join(args), flush=True)
    out = subprocess.run(
        [sys.executable, "-m", "modelpack.cli", *args],
        check=False,
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
    )
    if out.returncode != 0:
        sys.stderr.write(out.stdout + out.stderr)
        raise SystemExit(f"demo step failed: modelpack {' '.join(args)}")
    if show:
        sys.stdout.write(out.stdout)
    return out.stdout


def tiny_llama(seed: int):  # type: ignore[no-untyped-def]
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    return LlamaForCausalLM(config).eval()


class LocalRegistry:
    """Debian's ``docker-registry`` (distribution 2.8) on a free loopback port, storage under
    ``base``; anonymous plain HTTP, for this demo only."""

    def __init__(self, base: Path) -> None:
        base.mkdir(parents=True, exist_ok=True)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.host = f"127.0.0.1:{port}"
        config = base / "config.yml"
        config.write_text(
            f"version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {base / 'storage'}\n"
            f"http:\n  addr: {self.host}\n"
        )
        self._log = open(base / "registry.log", "wb")
        self.process = subprocess.Popen(
            [REGISTRY_BIN, "serve", str(config)], stdout=self._log, stderr=self._log
        )
        deadline = time.monotonic() + 20
        while True:
            try:
                with urllib.request.urlopen(f"http://{self.host}/v2/", timeout=1):
                    return
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise SystemExit(
                        f"docker-registry did not start; its log: {base / 'registry.log'}"
                    ) from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()


def main(out: Path) -> None:
    import torch

    from modelpack.loader import emit_check, load_into
    from modelpack.signing.keys import load_public_key

    work = out.resolve()
    marker = work / ".modelpack-demo"
    if work.exists() and any(work.iterdir()) and not marker.exists():
        raise SystemExit(f"{work} is not empty and not a folder this demo made: name another --out")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    marker.touch()
    t0 = time.monotonic()
    events = str(work / "events.jsonl")

    step("1. generate a tiny Llama with transformers (fixed seed, safetensors)")
    original = tiny_llama(seed=0)
    ckpt = work / "checkpoint"
    original.save_pretrained(ckpt, safe_serialization=True)
    prompt = torch.tensor([[1, 17, 42, 99, 7, 3]])
    with torch.no_grad():
        reference_logits = original(prompt).logits
    for p in sorted(ckpt.iterdir()):
        print(f"  {p.name:28} {p.stat().st_size:>10,} bytes")

    step("2. pack it into an OCI image layout (no server needed) and inspect it")
    layout = work / "layout"
    run(
        "pack", str(ckpt), f"oci:{layout}:v1", "--name", "tiny-llama", "--version", "1.0", "--progress", "off"
    )
    run("inspect", f"oci:{layout}:v1")

    step("3. CI: a signing key, then push (+ sign: manifest, model_signing, chunk table)")
    run("keygen", "--out", str(work / "ci"))
    server = None
    if os.path.exists(REGISTRY_BIN):
        server = LocalRegistry(work / "registry")
        ref = f"{server.host}/demo/tiny-llama:v1"
        print(f"local registry (Debian's docker-registry) on {server.host}")
        pushed = json.loads(
            run(
                "push",
                str(ckpt),
                ref,
                "--sign-key",
                str(work / "ci.key"),
                "--progress",
                "off",
                "--json",
                show=False,
            )
        )
        print(
            f"pushed {pushed['reference']}\n  digest {pushed['digest']} (the same as the layout's: packing is reproducible)"
        )
        repo_glob = ref.rsplit(":", 1)[0]
    else:
        print("docker-registry is not installed: the OCI layout is the registry for this run")
        ref = f"oci:{layout}:v1"
        run("sign", ref, "--key", str(work / "ci.key"))
        repo_glob = f"oci:{layout}"
    try:
        step("4. node: a trust policy, then pull-and-verify into the node cache (start 1: cold)")
        policy = work / "policy.yaml"
        policy.write_text(
            "version: 1\ndefault:\n  require_signature: true\nrules:\n"
            f"  - match: {json.dumps(repo_glob)}\n"
            f"    keys: [{{path: {json.dumps(str(work / 'ci.pub'))}}}]\n"
            "    require_signature: true\n    require_chunk_table: true\n"
        )
        cache = work / "cache"
        pulled = json.loads(
            run(
                "pull",
                ref,
                "--cache",
                str(cache),
                "--policy",
                str(policy),
                "--events",
                events,
                "--json",
                env={"MODELPACK_START_ID": "start-1"},
                show=False,
            )
        )
        digest = pulled["digest"]
        print(f"snapshot {pulled['path']}\n  state {pulled['cache']['state']}, digest {digest}")

        pub = load_public_key(str(work / "ci.pub"))

        def start(start_id: str, source: object, state: str | None = None) -> None:
            fresh = tiny_llama(seed=1234)  # different weights until the load replaces them
            stats = load_into(
                fresh,
                source,
                expected_digest=digest,
                trusted_keys=[pub],
                events=events,
                start_id=start_id,
                state=state,
            )
            with torch.no_grad():
                same = torch.equal(fresh(prompt).logits, reference_logits)
            emit_check(events, start_id=start_id, digest=digest, passed=same)
            print(
                f"  {start_id}: loaded {stats.bytes_read:,} bytes ({stats.state}); logits identical: {same}"
            )
            if not same:
                raise SystemExit("t9 check failed: logits differ")

        step("5. load the snapshot through the streaming loader, t9 check against the original logits")
        start("start-1", pulled["path"], state=pulled["cache"]["state"])

        step("6. start 2: the same pull is a node-cache hit (no hashing, no download)")
        pinned = f"{ref.rsplit(':', 1)[0]}@{digest}"  # consumers pin digests: no tag lookup at all
        again = json.loads(
            run(
                "pull",
                pinned,
                "--cache",
                str(cache),
                "--policy",
                str(policy),
                "--events",
                events,
                "--json",
                env={"MODELPACK_START_ID": "start-2"},
                show=False,
            )
        )
        print(f"  state {again['cache']['state']}")
        start("start-2", again["path"], state=again["cache"]["state"])

        if server is not None:
            step("7. start 3: stream straight from the registry by range reads, chunk-verified")
            start("start-3", pinned, state="streamed")

        step("8. the start-up timeline over all starts (p50/p95 per stage and cache state)")
        run("timeline", events)
    finally:
        if server is not None:
            server.stop()
    print(f"\ndemo finished in {time.monotonic() - t0:.1f} s; artifact {digest}")


def _cli(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m modelpack.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, default=Path("modelpack-demo"), help="working folder (emptied first)"
    )
    main(parser.parse_args(argv).out)


if __name__ == "__main__":
    _cli()
