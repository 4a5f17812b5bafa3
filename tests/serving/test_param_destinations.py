"""Streamed tensors read straight into the engine's parameters, and the cases
where the dry run of ``load_weights`` must send a tensor down the copy path instead.

The model is laid out the way vLLM lays out a Llama (q/k/v stacked in ``qkv_proj``, gate/up in
``gate_up_proj``, the vocabulary padded to a multiple of 64 and the padding zeroed by the
embedding's loader), with weight loaders that narrow and ``copy_`` as vLLM's do. vLLM itself runs
this path in ``tests/serving/test_vllm.py``. Every case compares every parameter with the same model loaded
from ``safetensors``' own tensors, so a wrong placement can only fail.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from modelpack.loader import LoadStats, ReadPlan
from modelpack.loader.device_standin import StandinDevice
from modelpack.signing.chunks import compute_chunk_table, push_chunk_table
from modelpack.signing.keys import generate_key
from torch import nn

from modelpack.errors import ChunkDigestMismatch, DigestMismatchError, ServingConfigError
from modelpack.serving.full_shape import iter_full_shape
from modelpack.serving.param_destinations import ParameterDestinations
from modelpack.serving.settings import ServingSettings
from modelpack.testdata.synthetic import SyntheticSpec, write_checkpoint
from tests.loader_helpers import Layout, corrupt, pack_layout, reference_tensors

# vocab 1000: padded to 1024 like vLLM's VocabParallelEmbedding, so a fill_ sits beside the copy
SPEC = SyntheticSpec(
    hidden=128, intermediate=256, layers=2, heads=4, kv_heads=2, vocab=1000, dtype="F32", shards=2
)
STACKED = [
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
]


def _weight(*shape: int, loader: Callable[..., None] | None = None) -> nn.Module:
    m = nn.Module()
    m.weight = nn.Parameter(torch.empty(shape), requires_grad=False)
    if loader is not None:
        m.weight.weight_loader = loader  # type: ignore[attr-defined]
    return m


def _default_loader(param: torch.Tensor, w: torch.Tensor) -> None:
    assert param.shape == w.shape
    param.data.copy_(w)


def _vocab_loader(param: torch.Tensor, w: torch.Tensor) -> None:
    param.data[: w.shape[0]].copy_(w)
    param.data[w.shape[0] :].fill_(0)


class VllmShapedLlama(nn.Module):
    """A Llama as vLLM holds it; ``load_weights`` is vLLM's stacked-params loop."""

    def __init__(self, spec: SyntheticSpec = SPEC) -> None:
        super().__init__()
        h, i = spec.hidden, spec.intermediate
        self.q, self.kv = h, h * spec.kv_heads // spec.heads
        self.i = i
        vocab = -(-spec.vocab // 64) * 64
        self.model = nn.Module()
        self.model.embed_tokens = _weight(vocab, h, loader=_vocab_loader)
        self.model.layers = nn.ModuleList()
        for _ in range(spec.layers):
            layer = nn.Module()
            layer.input_layernorm = _weight(h)
            layer.post_attention_layernorm = _weight(h)
            layer.self_attn = nn.Module()
            layer.self_attn.qkv_proj = _weight(self.q + 2 * self.kv, h, loader=self._qkv)
            layer.self_attn.o_proj = _weight(h, h)
            layer.mlp = nn.Module()
            layer.mlp.gate_up_proj = _weight(2 * i, h, loader=self._gate_up)
            layer.mlp.down_proj = _weight(h, i)
            self.model.layers.append(layer)
        self.model.norm = _weight(h)
        self.lm_head = _weight(vocab, h, loader=_vocab_loader)

    def _qkv(self, param: torch.Tensor, w: torch.Tensor, shard: str) -> None:
        off, size = {"q": (0, self.q), "k": (self.q, self.kv), "v": (self.q + self.kv, self.kv)}[shard]
        dst = param.data.narrow(0, off, size)
        w = w.narrow(0, 0, size)  # vLLM narrows to the rank's part: the whole tensor at TP=1
        assert dst.shape == w.shape
        dst.copy_(w)

    def _gate_up(self, param: torch.Tensor, w: torch.Tensor, shard: int) -> None:
        dst = param.data.narrow(0, shard * self.i, self.i)
        assert dst.shape == w.shape
        dst.copy_(w)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded = set()
        for name, w in weights:
            for pname, wname, shard in STACKED:
                if wname in name:
                    target = name.replace(wname, pname)
                    params[target].weight_loader(params[target], w, shard)  # type: ignore[attr-defined]
                    break
            else:
                target = name
                getattr(params[name], "weight_loader", _default_loader)(params[name], w)
            loaded.add(target)
        return loaded


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("ckpt")
    write_checkpoint(str(d), SPEC)
    return d


@pytest.fixture(scope="module")
def expected(ckpt: Path) -> dict[str, torch.Tensor]:
    """Every parameter of the model loaded from safetensors' own tensors (the copy path)."""
    model = VllmShapedLlama()
    model.load_weights(reference_tensors(ckpt).items())
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture
def signed(ckpt: Path, tmp_path: Path) -> tuple[Layout, Any]:
    layout = pack_layout(ckpt, tmp_path / "layout")
    key = generate_key()
    table = compute_chunk_table(layout.target, layout.manifest, chunk_size=64 * 1024)
    push_chunk_table(layout.target, layout.desc, table, key)
    return layout, key


def _load(
    model: VllmShapedLlama, source: Any, **fields: Any
) -> tuple[ParameterDestinations, list[tuple[str, torch.Tensor]], LoadStats]:
    """The model's load_weights over a stream whose whole tensors go where its dry run says."""
    found: list[ParameterDestinations] = []
    handed: list[tuple[str, torch.Tensor]] = []
    stats = LoadStats()

    def into(plan: ReadPlan) -> dict[str, torch.Tensor]:
        found.append(ParameterDestinations.trace(model, plan))
        return found[0].tensors

    def watch(it: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in it:
            handed.append((name, t))
            yield name, t

    model.load_weights(watch(iter_full_shape(source, into=into, stats=stats, **fields)))
    return found[0], handed, stats


def _inside_a_parameter(model: nn.Module, t: torch.Tensor) -> bool:
    start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    for p in model.parameters():
        s = p.untyped_storage()
        if s.data_ptr() <= start and end <= s.data_ptr() + s.nbytes():
            return True
    return False


def _assert_same(model: nn.Module, expected: dict[str, torch.Tensor]) -> None:
    got = dict(model.named_parameters())
    assert set(got) == set(expected)
    for name, want in expected.items():
        assert torch.equal(got[name], want), name


@pytest.mark.parametrize("copier", ["host", "standin"], indirect=True)
def test_a_signed_stream_lands_in_the_parameters_themselves(
    signed: tuple[Layout, Any], expected: dict[str, torch.Tensor], copier: StandinDevice | None
) -> None:
    """Every whole tensor is read into the parameter region the dry run found. Through the
    stand-in device (a GPU's semantics: the parameters are device memory) each verified block is
    copied asynchronously from its pinned slot straight into that region, and a tensor reaches
    ``load_weights`` only after its copies completed."""
    layout, key = signed
    model = VllmShapedLlama()
    dests, handed, stats = _load(model, layout.ref, trusted_keys=[key.public])
    _assert_same(model, expected)
    assert stats.plan is not None and set(stats.verification.values()) == {"chunks"}
    # every checkpoint tensor was placed, and each one handed over is the parameter's own memory
    assert dests.reason == "" and set(dests.tensors) == {t.name for t in stats.plan.tensors}
    assert dests.nbytes == stats.plan.total_bytes
    assert handed and all(_inside_a_parameter(model, t) for _, t in handed)
    # the q, k and v of a layer sit side by side in its qkv_proj, in that order
    qkv = model.model.layers[0].self_attn.qkv_proj.weight
    q = dict(handed)["model.layers.0.self_attn.q_proj.weight"]
    v = dict(handed)["model.layers.0.self_attn.v_proj.weight"]
    assert q.data_ptr() == qkv.data_ptr()
    assert v.data_ptr() + v.numel() * 4 == qkv.data_ptr() + qkv.numel() * 4


def test_the_dry_run_writes_nothing(signed: tuple[Layout, Any]) -> None:
    from modelpack.loader import prepare

    layout, key = signed
    prep = prepare(layout.ref, trusted_keys=[key.public])
    plan = prep.plan
    prep.close()
    model = VllmShapedLlama()
    for p in model.parameters():
        p.data.fill_(7.0)
    dests = ParameterDestinations.trace(model, plan)
    assert dests.tensors
    assert all(bool((p == 7.0).all()) for p in model.parameters())  # neither copy_ nor fill_ ran


@pytest.mark.parametrize("copier", ["host", "standin"], indirect=True)
@pytest.mark.parametrize("whole_layers", [False, True], ids=["chunk-table", "whole-layer-digest"])
def test_a_corrupt_blob_read_into_parameters_still_refuses_the_load(
    signed: tuple[Layout, Any], whole_layers: bool, copier: StandinDevice | None
) -> None:
    layout, key = signed
    _, blob = layout.weight_blob("00001")
    corrupt(blob, blob.stat().st_size // 2)
    model = VllmShapedLlama()
    with pytest.raises(DigestMismatchError if whole_layers else ChunkDigestMismatch):
        if whole_layers:
            _load(model, layout.ref)
        else:
            _load(model, layout.ref, trusted_keys=[key.public])


class Converting(VllmShapedLlama):
    """Casts every tensor before copying it (a model loading f32 weights as f16): no placement."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights((n, w.to(torch.float64).to(torch.float32)) for n, w in weights)


class Tied(VllmShapedLlama):
    """Copies the embedding into lm_head as well (one tensor, two destinations)."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def both() -> Iterator[tuple[str, torch.Tensor]]:
            for n, w in weights:
                if n == "lm_head.weight":
                    continue
                yield n, w
                if n == "model.embed_tokens.weight":
                    yield "lm_head.weight", w

        return super().load_weights(both())


class ZeroesFirst(VllmShapedLlama):
    """Zeroes the whole qkv_proj when its q arrives: k and v, read early, would be wiped."""

    def _qkv(self, param: torch.Tensor, w: torch.Tensor, shard: str) -> None:
        if shard == "q":
            param.data.zero_()
        super()._qkv(param, w, shard)


class ThroughATemporary(VllmShapedLlama):
    """Copies o_proj into a scratch tensor first: its first destination is no parameter."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def staged() -> Iterator[tuple[str, torch.Tensor]]:
            for n, w in weights:
                if n.endswith("o_proj.weight"):
                    scratch = torch.empty(w.shape, dtype=w.dtype)
                    scratch.copy_(w)
                    w = scratch
                yield n, w

        return super().load_weights(staged())


class ZeroesThenCopies(VllmShapedLlama):
    """Zeroes each norm and then copies into it: a write over exactly the copy's own region."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())

        def zeroed() -> Iterator[tuple[str, torch.Tensor]]:
            for n, w in weights:
                if "norm" in n:
                    params[n].data.zero_()
                yield n, w

        return super().load_weights(zeroed())


class ReadsValues(VllmShapedLlama):
    """Looks at a value while loading (a scale, a checksum): the dry run has no data to give."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def checked() -> Iterator[tuple[str, torch.Tensor]]:
            for n, w in weights:
                if n == "model.norm.weight" and not torch.isfinite(w).all():
                    raise ValueError("non-finite norm")
                yield n, w

        return super().load_weights(checked())


@pytest.mark.parametrize(
    ("cls", "copy_path", "reason"),
    [
        (Converting, "all", "dry run of load_weights stopped"),
        (Tied, {"embed_tokens", "lm_head"}, "copy path"),
        (ZeroesFirst, {".self_attn.q_proj.", ".self_attn.k_proj.", ".self_attn.v_proj."}, "copy path"),
        (ThroughATemporary, {".o_proj."}, "copy path"),
        (ReadsValues, "all", "dry run of load_weights stopped"),
        (ZeroesThenCopies, {"norm"}, "copy path"),
    ],
    ids=[
        "dtype-conversion",
        "one-tensor-two-places",
        "overlapping-write",
        "temporary",
        "reads-values",
        "same-region-write",
    ],
)
def test_what_the_dry_run_cannot_vouch_for_takes_the_copy_path(
    signed: tuple[Layout, Any],
    expected: dict[str, torch.Tensor],
    ckpt: Path,
    cls: type[VllmShapedLlama],
    copy_path: Any,
    reason: str,
) -> None:
    layout, key = signed
    want_model = cls()
    want_model.load_weights(reference_tensors(ckpt).items())
    want = {n: p.detach().clone() for n, p in want_model.named_parameters()}
    model = cls()
    dests, handed, stats = _load(model, layout.ref, trusted_keys=[key.public])
    _assert_same(model, want)
    assert stats.plan is not None
    names = {t.name for t in stats.plan.tensors}
    assert reason in dests.reason
    if copy_path == "all":
        assert dests.tensors == {}
    else:
        copied = {n for n in names if any(part in n for part in copy_path)}
        assert copied and copied.isdisjoint(dests.tensors)
        assert set(dests.tensors) == names - copied  # every other tensor still placed
        for name, t in handed:
            assert _inside_a_parameter(model, t) == (name in dests.tensors), name


class NonBlocking(VllmShapedLlama):
    """vLLM's loaders may pass ``non_blocking``: still a plain copy of the whole tensor."""

    def _gate_up(self, param: torch.Tensor, w: torch.Tensor, shard: int) -> None:
        param.data.narrow(0, shard * self.i, self.i).copy_(w, True)


def test_a_non_blocking_copy_is_placed_like_any_other(signed: tuple[Layout, Any], ckpt: Path) -> None:
    layout, key = signed
    want = NonBlocking()
    want.load_weights(reference_tensors(ckpt).items())
    model = NonBlocking()
    dests, _, stats = _load(model, layout.ref, trusted_keys=[key.public])
    _assert_same(model, {n: p.detach() for n, p in want.named_parameters()})
    assert stats.plan is not None and dests.reason == ""
    assert set(dests.tensors) == {t.name for t in stats.plan.tensors}


def test_a_checkpoint_that_does_not_fit_the_model_fails_as_it_would_without_placement(
    signed: tuple[Layout, Any],
) -> None:
    """The plan's names and shapes are the pusher's (pinned or signed, still hostile input): a dry
    run the model refuses places nothing, and the real load raises the model's own error."""
    import dataclasses

    layout, key = signed
    model = VllmShapedLlama(dataclasses.replace(SPEC, hidden=SPEC.hidden * 2))
    found: list[ParameterDestinations] = []

    def into(plan: ReadPlan) -> dict[str, torch.Tensor]:
        found.append(ParameterDestinations.trace(model, plan))
        return found[0].tensors

    with pytest.raises((AssertionError, RuntimeError)):  # the model's shape check, or copy_'s
        model.load_weights(iter_full_shape(layout.ref, into=into, trusted_keys=[key.public]))
    assert found[0].tensors == {} and "dry run of load_weights failed" in found[0].reason


def test_into_parameters_is_a_setting_that_must_be_a_boolean() -> None:
    pinned = "127.0.0.1:5000/m/llama@sha256:" + "ab" * 32
    assert ServingSettings.from_extra_config({"source": pinned}, {}).into_parameters is True
    assert (
        ServingSettings.from_extra_config({"source": pinned, "into_parameters": False}, {}).into_parameters
        is False
    )
    with pytest.raises(ServingConfigError, match="into_parameters"):
        ServingSettings.from_extra_config({"source": pinned, "into_parameters": "no"}, {})
