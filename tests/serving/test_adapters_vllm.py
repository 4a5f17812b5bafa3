"""vLLM (CPU) serves a base with its LoRA adapter from the node cache.

The tiny generated Llama of the vLLM tests is pushed as the base; a PEFT-format LoRA adapter
(q_proj/v_proj, rank 8, non-zero B) is generated for it and pushed with ``--base``; both are
pulled into a node cache with ``--with-adapters``. One OpenAI API server starts from the base
snapshot (load format ``modelpack``, digest pinned) with the flags ``vllm_lora_args`` builds from
the cache. The adapter's greedy tokens must differ from the base's and equal a reference computed
in plain torch/transformers with the LoRA merged (``W + alpha/r · B @ A``); the base's equal the
unmerged reference. While the server runs it holds the adapter snapshot's lease, so a ``cache gc``
under which everything may go keeps it (and the adapter still answers); once it stopped, gc
removes it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from modelpack.mount.cache import NodeCache

from modelpack.api.adapters import pull_with_adapters, push_adapter
from modelpack.api.transfer import push
from modelpack.cli import main
from modelpack.errors import AdapterBaseMismatchError
from modelpack.serving.lora_adapters import cached_adapters, vllm_lora_args
from modelpack.serving.readiness import complete, wait_healthy
from modelpack.testdata.peft_lora import write_lora_adapter
from tests.fixtures.registry import RegistryServer
from tests.vllm_helpers import (
    LLAMA_CONFIG,
    MAX_TOKENS,
    PROMPTS,
    VLLM_PYTHON,
    vllm_available,
    vllm_env,
    write_tiny_llama,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),  # one vLLM start (minutes on a loaded CPU), then requests and gc
    pytest.mark.skipif(
        not vllm_available(),
        reason=".venv-vllm is absent: build it with .ci/vllm-venv.sh (make test's set-up does)",
    ),
]

REPO = "adapters-vllm/tiny-llama"


def _reference(model_dir: Path, adapter_dir: Path | None, prompt: list[int]) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs from transformers, the LoRA merged into the weights."""
    import torch
    import transformers
    from safetensors.torch import load_file

    model = transformers.LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    if adapter_dir is not None:
        cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
        tensors = load_file(str(adapter_dir / "adapter_model.safetensors"))
        params = dict(model.named_parameters())
        scale = cfg["lora_alpha"] / cfg["r"]
        with torch.no_grad():
            for key, a in tensors.items():
                if key.endswith(".lora_A.weight"):
                    module = key[len("base_model.model.") : -len(".lora_A.weight")]
                    b = tensors[key.replace(".lora_A.", ".lora_B.")]
                    params[module + ".weight"].add_(scale * (b @ a))
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = [float(torch.log_softmax(s[0], -1)[t]) for s, t in zip(out.scores, tokens, strict=True)]
    return tokens, logprobs


def _gc(cache: Path) -> dict[str, Any]:
    """``cache gc`` under which every snapshot may go that nothing keeps."""
    out = CliRunner().invoke(
        main, ["cache", "gc", "--cache", str(cache), "--keep-versions", "0", "--min-age", "0", "--json"]
    )
    assert out.exit_code == 0, out.output
    doc: dict[str, Any] = json.loads(out.stdout)
    return doc


def test_vllm_serves_the_cached_base_with_its_adapter(tmp_path: Path, registry: RegistryServer) -> None:
    import subprocess

    from modelpack.serving.vllm_command import vllm_server_args
    from tests.fixtures.registry import free_port

    ckpt = write_tiny_llama(tmp_path / "base")
    adapter = Path(write_lora_adapter(str(tmp_path / "sql-lora"), LLAMA_CONFIG, rank=8, alpha=16, seed=1))
    base = push(str(ckpt), registry.ref(REPO, "v1"))
    pushed = push_adapter(str(adapter), registry.ref(REPO, "sql-lora"), f"@{base.digest}")
    # another base with an adapter of its own, pushed next to it
    other_ckpt = write_tiny_llama(tmp_path / "other", seed=7)
    other = push(str(other_ckpt), registry.ref(REPO, "other"))
    foreign = push_adapter(str(adapter), registry.ref(REPO, "foreign"), f"@{other.digest}", name="foreign")

    cache = NodeCache(str(tmp_path / "cache"))
    pulled = pull_with_adapters(registry.ref(REPO, "v1"), cache=cache)
    assert [a.name for a in pulled.adapters] == ["sql-lora"]
    pull_with_adapters(registry.ref(REPO, "other"), cache=cache)  # its adapter is cached too
    served = cached_adapters(cache, f"{registry.host}/{REPO}@{base.digest}")
    assert [(a.name, a.digest, a.rank) for a in served] == [("sql-lora", pushed.digest, 8)]
    assert served[0].path == pulled.adapters[0].path
    # naming the other base's adapter for this base: refused, both digests named
    with pytest.raises(AdapterBaseMismatchError) as info:
        cached_adapters(
            cache, f"{registry.host}/{REPO}@{base.digest}", [f"{registry.host}/{REPO}@{foreign.digest}"]
        )
    assert other.digest in str(info.value) and base.digest in str(info.value)
    flags = vllm_lora_args(served)
    assert flags == [
        "--enable-lora",
        "--max-lora-rank",
        "8",
        "--max-loras",
        "1",
        "--lora-modules",
        f"sql-lora={served[0].path}",
    ]
    # the CLI prints the same flags
    out = CliRunner().invoke(
        main,
        [
            "cache",
            "lora-args",
            f"{registry.host}/{REPO}@{base.digest}",
            "--cache",
            str(tmp_path / "cache"),
            "--json",
        ],
    )
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout)["args"] == flags

    port = free_port()
    argv = vllm_server_args(
        pulled.path,
        python=str(VLLM_PYTHON),
        extra_config={"expected_digest": base.digest},
        host="127.0.0.1",
        port=port,
        dtype="float32",
        served_model_name="tiny",
        extra_args=["--max-model-len", "256", "--enforce-eager", "--seed", "0", *flags],
    )
    log_path = tmp_path / "vllm.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            argv, env=vllm_env(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
    url = f"http://127.0.0.1:{port}"
    results: dict[str, Any] = {}
    try:
        wait_healthy(url, timeout=600, alive=lambda: proc.poll() is None)
        for prompt in PROMPTS:
            results.setdefault("base", []).append(complete(url, prompt, MAX_TOKENS, model="tiny"))
            results.setdefault("lora", []).append(complete(url, prompt, MAX_TOKENS, model="sql-lora"))
        # the running engine holds its adapter's lease: a gc under which everything may go keeps it
        doc = _gc(tmp_path / "cache")
        assert served[0].digest in doc["keptInUse"] and served[0].digest not in doc["evicted"], doc
        assert (Path(served[0].path) / "adapter_model.safetensors").exists()
        results["after_gc"] = complete(url, PROMPTS[0], MAX_TOKENS, model="sql-lora")
    except Exception:
        print(log_path.read_text(errors="replace")[-6000:])
        raise
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
    # the engine stopped: its lease went with it, and gc may remove the adapter
    assert served[0].digest in _gc(tmp_path / "cache")["evicted"]
    assert results["after_gc"] == results["lora"][0]
    for i, prompt in enumerate(PROMPTS):
        (base_tokens, base_lp), (lora_tokens, lora_lp) = results["base"][i], results["lora"][i]
        assert lora_tokens != base_tokens, (prompt, base_tokens)
        want_base = _reference(ckpt, None, prompt)
        want_lora = _reference(ckpt, adapter, prompt)
        assert base_tokens == want_base[0]
        assert base_lp == pytest.approx(want_base[1], abs=1e-3)
        assert lora_tokens == want_lora[0]
        assert lora_lp == pytest.approx(want_lora[1], abs=1e-3)
