"""vLLM test helpers: a tiny generated Llama with a local tokenizer, and vLLM run in ``.venv-vllm``.

vLLM lives in its own venv (``.ci/vllm-venv.sh``), so every vLLM run here is a subprocess of that
venv's python: an offline ``LLM`` (one engine start, several checks) or the OpenAI API server
(health endpoint → t8, deterministic request → t9). Nothing is downloaded: the weights come from
``transformers.LlamaConfig`` with a fixed seed, the tokenizer is a word-level one built with the
``tokenizers`` library.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
VLLM_VENV = Path(os.environ.get("MODELPACK_VLLM_VENV", str(ROOT / ".venv-vllm")))
VLLM_PYTHON = VLLM_VENV / "bin" / "python"

VOCAB = 256
# head_dim = hidden / heads = 32: vLLM's CPU attention kernels need 32, 64, …
LLAMA_CONFIG: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
# a tiny Qwen2-MoE (4 routed experts of which 2 per token, a shared expert and its gate, q/k/v
# biases): the layout of ``…mlp.experts.{i}.{gate,up,down}_proj`` that vLLM's FusedMoE loads
QWEN2_MOE_CONFIG: dict[str, Any] = {
    **LLAMA_CONFIG,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 128,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 1,
    "norm_topk_prob": False,
}
# a tiny Qwen3-MoE: Qwen2-MoE's expert names, no shared expert, per-head q_norm / k_norm
QWEN3_MOE_CONFIG: dict[str, Any] = {
    **LLAMA_CONFIG,
    "moe_intermediate_size": 64,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 1,
    "norm_topk_prob": True,
}
# a tiny Mixtral: ``…block_sparse_moe.experts.{i}.{w1,w2,w3}``, sized by ``intermediate_size``
MIXTRAL_CONFIG: dict[str, Any] = {
    **LLAMA_CONFIG,
    "intermediate_size": 64,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
}
# family → (transformers model class name, its config class name, the config)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", LLAMA_CONFIG),
    "qwen2_moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig", QWEN2_MOE_CONFIG),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", QWEN3_MOE_CONFIG),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", MIXTRAL_CONFIG),
}
PROMPTS: list[list[int]] = [[1, 17, 42, 7, 99, 3, 250, 64], [1, 5, 6, 7, 8, 200, 201, 9, 10]]
MAX_TOKENS = 8


def vllm_available() -> bool:
    return VLLM_PYTHON.exists()


def write_tiny_llama(
    directory: Path,
    seed: int = 0,
    config: Mapping[str, Any] | None = None,
    *,
    moe: bool = False,
    family: str | None = None,
) -> Path:
    """A float32 Llama (head_dim 32) with its config and a local tokenizer, as a plain directory;
    with ``family``, a model of that name in ``FAMILIES`` of the same attention and size (``moe``:
    ``family="qwen2_moe"``, a Qwen2-MoE).

    ``config`` overrides the family's config keys (the benchmark builds a larger model); the
    tokenizer always covers ``VOCAB`` words, which prompts given as token ids do not need more of.
    """
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    model_class, config_class, base = FAMILIES[family or ("qwen2_moe" if moe else "llama")]
    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model_config = getattr(transformers, config_class)(**{**base, **(config or {})}, torch_dtype="float32")
    model = getattr(transformers, model_class)(model_config).to(torch.float32).eval()
    # random init leaves logits nearly flat; sharper weights make greedy choices and logprobs distinct
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(4.0)
    model.save_pretrained(str(directory), safe_serialization=True)
    vocab = {f"w{i}": i for i in range(VOCAB)}
    vocab.update({"<unk>": 0, "<s>": 1, "</s>": 2})
    vocab = {k: v for k, v in sorted(vocab.items(), key=lambda kv: kv[1])}
    by_id: dict[int, str] = {}
    for k, v in vocab.items():
        by_id[v] = k
    tok = Tokenizer(models.WordLevel({t: i for i, t in by_id.items()}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "model_max_length": 256,
                "clean_up_tokenization_spaces": False,
            }
        )
    )
    (directory / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})
    )
    return directory


def vllm_env(
    events: Path | None = None, *, tp_size: int = 1, extra: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The environment vLLM needs on this CPU-only machine, and nothing that reaches the network."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "MODELPACK_"))}
    env.update(
        {
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "VLLM_LOGGING_LEVEL": "INFO",
            "PYTHONUNBUFFERED": "1",
        }
    )
    env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(tp_size)) if tp_size > 1 else "0-1"
    if events is not None:
        env["MODELPACK_EVENTS"] = str(events)
    env.update(extra or {})
    return env


# several engine starts in one process (vLLM imported once): each run builds an LLM, generates every
# prompt greedily, and reports tokens + logprobs, or the error that stopped it before serving
_OFFLINE = textwrap.dedent(
    """
    import gc, json, sys, traceback
    spec = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    if spec["tp"] > 1:
        # vLLM's CPU platform spawns its TP workers, each a fresh interpreter importing torch and
        # vLLM again (~12 s of CPU per worker, per engine start). A forkserver that imported them
        # once forks each worker from that state instead; the worker still loads modelpack's
        # plugin and builds its model on its own, as a spawned one does.
        import multiprocessing
        import vllm.utils.system_utils as _su
        import vllm.v1.executor.multiproc_executor as _mpe
        multiprocessing.set_forkserver_preload(["torch", "vllm", "vllm.v1.worker.cpu_worker",
                                                "vllm.v1.executor.multiproc_executor"])
        _ctx = multiprocessing.get_context("forkserver")
        def _mp_context():
            _su._maybe_force_spawn()
            return _ctx
        _su.get_mp_context = _mpe.get_mp_context = _mp_context
    for run in spec["runs"]:
        kwargs = dict(model=run["model"], dtype="float32", tensor_parallel_size=spec["tp"],
                      max_model_len=256, enforce_eager=run.get("enforce_eager", True), seed=0,
                      load_format=run["load_format"],
                      trust_remote_code=run.get("trust_remote_code", False))
        if spec["tp"] == 1:
            kwargs["distributed_executor_backend"] = "uni"
        if run.get("extra") is not None:
            kwargs["model_loader_extra_config"] = run["extra"]
        if run.get("save_sharded") is not None:
            kwargs["worker_extension_cls"] = "tests.sharded_state_saver.ShardedStateSaver"
        try:
            llm = LLM(**kwargs)
        except Exception as exc:
            traceback.print_exc()
            print("RESULT " + json.dumps({"name": run["name"], "error": f"{type(exc).__name__}: {exc}"}), flush=True)
            continue
        sp = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], logprobs=1, ignore_eos=True)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]], sp)
        res = []
        for o in outs:
            c = o.outputs[0]
            res.append({"tokens": list(c.token_ids),
                        "logprobs": [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]})
        doc = {"name": run["name"], "outputs": res}
        if run.get("save_sharded") is not None:  # each TP worker writes its rank's files
            doc["saved"] = llm.collective_rpc("modelpack_save_sharded_state", args=tuple(run["save_sharded"]))
        print("RESULT " + json.dumps(doc), flush=True)
        llm.llm_engine.engine_core.shutdown() if hasattr(llm.llm_engine, "engine_core") else None
        del llm
        gc.collect()
    """
)


@dataclass
class EngineRun:
    """One engine start: the model directory, its load format and extra config; ``enforce_eager``
    False lets vLLM compile (torch.compile with Inductor's CPU backend), which takes tens of seconds;
    ``trust_remote_code`` lets transformers import the ``modeling_*.py`` a config's ``auto_map`` names;
    ``save_sharded`` ``(directory, part bytes)``: after generating, each TP worker writes its rank's
    ``sharded_state`` files there (``tests/sharded_state_saver.py``), listed under ``"saved"``."""

    name: str
    model: Path | str
    load_format: str
    extra: Mapping[str, Any] | None = None
    enforce_eager: bool = True
    trust_remote_code: bool = False
    save_sharded: tuple[str, int] | None = None


def run_offline(
    runs: Sequence[EngineRun],
    *,
    tp_size: int = 1,
    events: Path | None = None,
    env_extra: Mapping[str, str] | None = None,
    prompts: Sequence[Sequence[int]] = PROMPTS,
    timeout: float = 300,
) -> tuple[subprocess.CompletedProcess[str], dict[str, dict[str, Any]]]:
    """(the finished process, {run name: {"outputs": [...]} or {"error": "..."}}).

    The engine core runs in this one process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so vLLM is
    imported once for all runs: TP=1 with the ``uni`` executor (no other process), TP=2 with
    vLLM's two worker processes per start and no engine-core process (on two cores, a start
    spared spawning and importing one more vLLM process).
    """
    spec = {
        "runs": [
            {
                "name": r.name,
                "model": str(r.model),
                "load_format": r.load_format,
                "extra": dict(r.extra) if r.extra is not None else None,
                "enforce_eager": r.enforce_eager,
                "trust_remote_code": r.trust_remote_code,
                "save_sharded": list(r.save_sharded) if r.save_sharded is not None else None,
            }
            for r in runs
        ],
        "tp": tp_size,
        "prompts": [list(p) for p in prompts],
        "max_tokens": MAX_TOKENS,
    }
    extra_env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if any(r.save_sharded is not None for r in runs):  # the workers import the saver from tests/
        extra_env["PYTHONPATH"] = str(ROOT)
    extra_env.update(env_extra or {})
    proc = subprocess.run(
        [str(VLLM_PYTHON), "-c", _OFFLINE, json.dumps(spec)],
        env=vllm_env(events, tp_size=tp_size, extra=extra_env),
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        cwd=str(ROOT),
    )
    results: dict[str, dict[str, Any]] = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            doc = json.loads(line[len("RESULT ") :])
            results[doc.pop("name")] = doc
    return proc, results


@dataclass
class VllmServer:
    """A running OpenAI API server of ``.venv-vllm`` on a loopback port."""

    process: subprocess.Popen[bytes]
    url: str
    log_path: Path

    def alive(self) -> bool:
        return self.process.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=30)


def start_server(
    model: Path | str,
    *,
    log_path: Path,
    extra: Mapping[str, Any] | None = None,
    load_format: str = "modelpack",
    tp_size: int = 1,
    events: Path | None = None,
    env_extra: Mapping[str, str] | None = None,
) -> VllmServer:
    """Start ``python -m vllm.entrypoints.openai.api_server`` (float32, eager) on a free port."""
    from modelpack.serving.vllm_command import vllm_server_args
    from tests.fixtures.registry import free_port

    port = free_port()
    argv = vllm_server_args(
        str(model),
        python=str(VLLM_PYTHON),
        load_format=load_format,
        extra_config=extra,
        tp_size=tp_size,
        host="127.0.0.1",
        port=port,
        dtype="float32",
        served_model_name="tiny",
        extra_args=["--max-model-len", "256", "--enforce-eager", "--seed", "0"],
    )
    log = open(log_path, "ab")
    try:
        proc = subprocess.Popen(
            argv,
            env=vllm_env(events, tp_size=tp_size, extra=env_extra),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=str(ROOT),
        )
    finally:
        log.close()
    return VllmServer(proc, f"http://127.0.0.1:{port}", log_path)


def tail(proc: subprocess.CompletedProcess[str], n: int = 6000) -> str:
    return (proc.stdout[-n // 3 :] + "\n--- stderr ---\n" + proc.stderr[-n:]) if proc else ""


def events_of(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


if __name__ == "__main__":  # manual: python -m tests.vllm_helpers DIR
    write_tiny_llama(Path(sys.argv[1]))
