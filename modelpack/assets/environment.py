"""The running environment's fingerprint: probe the device and the software, plan the ranks.

Two halves. The machine half (device kind and architecture, driver and CUDA versions, torch,
Triton, vLLM and Python versions) is probed here. The model half (dtype, quantization, TP size
and rank layout, manifest digest) comes from the model's own headers through the loader's
planner, so an asset is matched against the same layout the loader will produce. Probes that
cannot answer leave the field empty, which never matches: a machine we cannot describe starts cold.
"""

from __future__ import annotations

import fnmatch
import hashlib
import importlib.metadata
import platform
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from modelpack.assets.fingerprint import ABSENT, EnvironmentFingerprint
from modelpack.oci.descriptor import Descriptor, canonical_json
from modelpack.targets.base import ReadableTarget

if TYPE_CHECKING:  # the loader imports torch: only the functions that read a model need it
    from modelpack.loader import PreparedLoad, ReadPlan
    from modelpack.loader.fingerprint import Fingerprint as LoadFingerprint
    from modelpack.loader.plan import RulesLike

# Instruction-set extensions (Linux /proc/cpuinfo names) a compiler targeting "-march=native" may
# use; inductor compiles its CPU kernels that way, so a kernel built with one of them crashes
# (SIGILL) on a machine without it. Bookkeeping flags (hypervisor, constant_tsc, …) vary between
# identical hosts and are left out, or every replica would refuse every other one's cache.
_X86_ISA = (
    "mmx", "sse*", "pni", "ssse3", "avx*", "amx*", "fma*", "f16c", "bmi*", "adx", "aes", "vaes",
    "pclmulqdq", "vpclmulqdq", "gfni", "sha_ni", "popcnt", "abm", "lzcnt", "movbe", "cx16", "xsave",
    "xsavec", "xsaveopt", "xsaves", "rdrand", "rdseed", "clflushopt", "clwb", "movdir*", "serialize",
    "xop", "lm", "3dnowprefetch", "rdpid", "fsgsbase", "cldemote", "waitpkg", "enqcmd", "hreset",
    "tsxldtrk", "uintr",
)  # fmt: skip

_DTYPE_ALIASES = {
    "float32": "F32", "float": "F32", "fp32": "F32", "float16": "F16", "half": "F16", "fp16": "F16",
    "bfloat16": "BF16", "bf16": "BF16", "float64": "F64", "double": "F64", "int8": "I8", "uint8": "U8",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "fp8": "F8_E4M3",
}  # fmt: skip


def normalize_dtype(dtype: str) -> str:
    """``torch.bfloat16`` / ``bfloat16`` / ``bf16`` / ``BF16`` → ``BF16`` (the loader's spelling);
    comma-separated lists are normalised part by part and sorted."""
    parts = []
    for part in dtype.split(","):
        p = part.strip().removeprefix("torch.")
        parts.append(_DTYPE_ALIASES.get(p.lower(), p.upper()))
    return ",".join(sorted(p for p in parts if p))


def _package_version(*names: str) -> str:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return ABSENT


def _cpu_flags() -> list[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return value.split()
    except OSError:
        pass
    return []


def cpu_arch() -> str:
    """``<machine>;torch=<ATen vector ISA>;isa=<sorted extensions>``; empty when nothing is known."""
    machine = platform.machine()
    flags = _cpu_flags()
    if machine in ("x86_64", "AMD64", "i686"):
        flags = [f for f in flags if any(fnmatch.fnmatchcase(f, p) for p in _X86_ISA)]
    try:
        import torch

        capability = torch.backends.cpu.get_cpu_capability()
    except Exception:  # no torch here (an init container): the field stays empty
        capability = ""
    if not machine or not flags or not capability:
        return ""
    return f"{machine};torch={capability};isa={','.join(sorted(set(flags)))}"


def _nvidia_driver_version() -> str:
    try:
        with open("/proc/driver/nvidia/version", encoding="utf-8", errors="replace") as f:
            first = f.readline()
    except OSError:
        first = ""
    # "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 …"
    for word in first.split():
        if word[:1].isdigit() and "." in word:
            return word
    try:
        import pynvml  # type: ignore[import-not-found,unused-ignore]

        pynvml.nvmlInit()
        try:
            v = pynvml.nvmlSystemGetDriverVersion()
            return v.decode() if isinstance(v, bytes) else str(v)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML: the driver stays unknown, so nothing matches
        return ""


def probe_device(device: Any = "cpu") -> dict[str, str]:
    """device_kind, device_arch, driver_version, cuda_version of ``device`` (``cpu``, ``cuda:1``…)."""
    import torch

    dev = torch.device(device)
    if dev.type == "cpu":
        return {
            "device_kind": "cpu",
            "device_arch": cpu_arch(),
            "driver_version": ABSENT,
            "cuda_version": ABSENT,
        }
    if dev.type != "cuda":
        return {"device_kind": dev.type, "device_arch": "", "driver_version": "", "cuda_version": ""}
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    if torch.version.hip:
        arch = str(getattr(torch.cuda.get_device_properties(index), "gcnArchName", ""))
        return {
            "device_kind": "rocm",
            "device_arch": arch,
            "driver_version": "",
            "cuda_version": torch.version.hip,
        }
    major, minor = torch.cuda.get_device_capability(index)
    return {
        "device_kind": "cuda",
        "device_arch": f"sm_{major}{minor}",
        "driver_version": _nvidia_driver_version(),
        "cuda_version": torch.version.cuda or "",
    }


def probe_software() -> dict[str, str]:
    try:
        import torch

        torch_version = str(torch.__version__)
    except ImportError:
        torch_version = ABSENT
    impl = sys.implementation.name
    return {
        "torch_version": torch_version,
        "triton_version": _package_version("triton", "pytorch-triton", "pytorch-triton-rocm"),
        "vllm_version": _package_version("vllm"),
        "python_version": f"{impl}-{sys.version_info.major}.{sys.version_info.minor}",
    }


def layout_of_all_ranks(
    headers: Any, tp_size: int, rules: RulesLike = None, *, presets: bool = True, uneven: str = "refuse"
) -> str:
    """sha256 over each rank's loader layout digest, in rank order: one asset serves every rank of
    one layout (a node-wide cache holds all ranks' graphs), and any change of shard shape shows."""

    from modelpack.loader import ReadPlan
    from modelpack.loader.fingerprint import rank_layout_digest

    per_rank = []
    for rank in range(tp_size):
        plan = ReadPlan.build(headers, tp_size, rank, rules, presets=presets, uneven=uneven)
        per_rank.append(rank_layout_digest({t.name: (t.rule.value, t.shape) for t in plan.tensors}))
    return "sha256:" + hashlib.sha256(canonical_json(per_rank)).hexdigest()


def fingerprint_from_prepared(
    prepared: PreparedLoad,
    *,
    device: Any = "cpu",
    rules: RulesLike = None,
    presets: bool = True,
    uneven: str = "refuse",
    dtype: str | None = None,
    quantization: str | None = None,
) -> EnvironmentFingerprint:
    """The running fingerprint for a load the loader already prepared (headers read, digest pinned).
    ``dtype``/``quantization`` name what the engine computes in when it casts or quantises."""
    return _fingerprint(
        prepared.headers,
        prepared.fingerprint,
        prepared.plan.tp_size,
        device=device,
        rules=rules,
        presets=presets,
        uneven=uneven,
        dtype=dtype,
        quantization=quantization,
    )


def fingerprint_from_plan(
    plan: ReadPlan,
    load_fingerprint: LoadFingerprint,
    *,
    device: Any = "cpu",
    rules: RulesLike = None,
    presets: bool = True,
    dtype: str | None = None,
    quantization: str | None = None,
) -> EnvironmentFingerprint:
    """The running fingerprint of a load that already ran (an engine's rank after its weights
    landed): the plan carries each file's header, the loader's fingerprint the digest and dtypes;
    ``rules``/``presets`` must be the ones the load used, so every rank's layout is re-planned alike."""
    headers = {name: fp.header for name, fp in plan.files.items()}
    return _fingerprint(
        headers,
        load_fingerprint,
        plan.tp_size,
        device=device,
        rules=rules,
        presets=presets,
        uneven=plan.uneven,
        dtype=dtype,
        quantization=quantization,
    )


def _fingerprint(
    headers: Any,
    lfp: LoadFingerprint,
    tp_size: int,
    *,
    device: Any,
    rules: RulesLike,
    presets: bool,
    uneven: str,
    dtype: str | None,
    quantization: str | None,
) -> EnvironmentFingerprint:
    return EnvironmentFingerprint(
        manifest_digest=lfp.manifest_digest,
        dtype=normalize_dtype(dtype) if dtype else lfp.dtype,
        quantization=quantization or lfp.quantization,
        tp_size=tp_size,
        rank_layout=layout_of_all_ranks(headers, tp_size, rules, presets=presets, uneven=uneven),
        **probe_device(device),
        **probe_software(),
    )


def running_fingerprint(
    target: ReadableTarget,
    model: Descriptor,
    *,
    device: Any = "cpu",
    tp_size: int = 1,
    rules: RulesLike = None,
    presets: bool = True,
    uneven: str = "refuse",
    dtype: str | None = None,
    quantization: str | None = None,
    trusted_keys: Sequence[Any] | None = None,
) -> EnvironmentFingerprint:
    """This machine's fingerprint for the model at ``model`` in ``target``: only the safetensors
    headers are read (range reads, chunk-verified when ``trusted_keys`` find a signed table)."""
    from modelpack.loader import LoaderOptions, prepare

    prep = prepare(
        (target, str(model.digest)),
        device="cpu",
        tp_size=tp_size,
        tp_rank=0,
        rules=rules,
        presets=presets,
        expected_digest=str(model.digest),
        trusted_keys=trusted_keys,
        options=LoaderOptions(uneven=uneven),
    )
    try:
        return fingerprint_from_prepared(
            prep,
            device=device,
            rules=rules,
            presets=presets,
            uneven=uneven,
            dtype=dtype,
            quantization=quantization,
        )
    finally:
        prep.close()
