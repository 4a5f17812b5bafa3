"""`make demo`: the main job end to end on an embedded default.

generate a synthetic checkpoint → pack into an OCI layout → inspect. Everything lands under
examples/generated/ (ignored by git); rerunning starts from scratch.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "generated")
MODELPACK = os.path.join(os.path.dirname(sys.executable), "modelpack")


def step(title: str) -> None:
    print(f"\n=== {title}", flush=True)


def run(*args: str) -> str:
    print("$ modelpack " + " ".join(args), flush=True)
    out = subprocess.run([MODELPACK, *args], check=True, capture_output=True, text=True)
    sys.stdout.write(out.stdout)
    return out.stdout


def main() -> None:
    from modelpack.synthetic import SyntheticSpec, write_checkpoint

    shutil.rmtree(OUT, ignore_errors=True)
    os.makedirs(OUT)
    t0 = time.monotonic()

    step("1. generate a synthetic Llama-shaped checkpoint (bf16 safetensors, 2 shards)")
    ckpt = os.path.join(OUT, "checkpoint")
    for path in write_checkpoint(
        ckpt, SyntheticSpec(hidden=512, intermediate=1376, layers=4, vocab=4096, shards=2)
    ):
        print(f"  {os.path.relpath(path, OUT):45} {os.path.getsize(path):>10,} bytes")

    step("2. pack it into an OCI image layout (no server needed)")
    layout = os.path.join(OUT, "layout")
    digest = run("pack", ckpt, f"oci:{layout}:v1", "--version", "1.0", "--progress", "off").split()[-1]

    step("3. inspect the artifact")
    run("inspect", f"oci:{layout}:v1")
    run("ls", f"oci:{layout}")

    step("4. the layout is a standard OCI layout: skopeo reads our exact manifest bytes")
    if shutil.which("skopeo"):
        raw = subprocess.run(
            ["skopeo", "inspect", "--raw", f"oci:{layout}:v1"], check=True, capture_output=True
        ).stdout
        import hashlib

        ok = "sha256:" + hashlib.sha256(raw).hexdigest() == digest
        print(f"skopeo manifest digest matches: {ok}")
        if not ok:
            sys.exit(1)
    else:
        print("skopeo not installed; skipped")

    print(f"\ndemo finished in {time.monotonic() - t0:.1f} s; artifact {digest}")


if __name__ == "__main__":
    main()
