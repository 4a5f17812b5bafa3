"""One options object for the loader's public API: ``LoadRequest`` / ``LoadFields``."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from modelpack.loader import (
    LoaderOptions,
    LoadFields,
    LoadRequest,
    LoadStats,
    iter_tensors,
    load_into,
    load_state_dict,
)
from modelpack.loader.plan import ReadPlan

from modelpack.testdata.synthetic import SyntheticSpec, write_checkpoint
from tests.loader_helpers import expected_shard, reference_tensors


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("req-ckpt")
    write_checkpoint(str(d), SyntheticSpec(shards=2, seed=5))
    return d


def test_the_keywords_are_exactly_the_request_fields() -> None:
    assert LoadFields.__optional_keys__ | LoadFields.__required_keys__ == {
        f.name for f in dataclasses.fields(LoadRequest)
    }


def test_a_request_and_keywords_load_the_same_and_keywords_override(ckpt: Path) -> None:
    ref = reference_tensors(ckpt)
    req = LoadRequest(tp_size=2, tp_rank=0, allow_unverified=True, options=LoaderOptions(workers=1))
    plans: list[ReadPlan] = []
    by_request = load_state_dict(str(ckpt), req.replace(on_plan=plans.append))
    by_keywords = load_state_dict(str(ckpt), "cpu", tp_size=2, tp_rank=0, allow_unverified=True)
    assert by_request.keys() == by_keywords.keys() == ref.keys()
    rules = {t.name: t.rule for t in plans[0].tensors}
    for name in ref:
        assert torch.equal(by_request[name], by_keywords[name])
        assert torch.equal(by_request[name], expected_shard(ref[name], rules[name], 2, 0))
    stats = LoadStats()
    rank1 = dict(iter_tensors(str(ckpt), req, tp_rank=1, stats=stats))  # keyword over the request
    assert stats.plan is not None and stats.plan.tp_rank == 1
    for name in ref:
        assert torch.equal(rank1[name], expected_shard(ref[name], rules[name], 2, 1))


def test_unknown_parameters_are_refused(ckpt: Path) -> None:
    with pytest.raises(TypeError, match="tp_sise"):
        load_state_dict(str(ckpt), allow_unverified=True, tp_sise=2)  # type: ignore[call-arg]


def test_load_into_runs_the_callers_on_plan_after_its_own_check(ckpt: Path) -> None:
    ref = reference_tensors(ckpt)
    module = torch.nn.Module()
    for name, t in ref.items():
        parent = module
        *path, leaf = name.split(".")
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, torch.nn.Module())
            parent = getattr(parent, part)
        parent.register_parameter(leaf, torch.nn.Parameter(torch.zeros_like(t), requires_grad=False))
    seen: list[ReadPlan] = []
    load_into(module, str(ckpt), LoadRequest(allow_unverified=True, on_plan=seen.append))
    assert len(seen) == 1
    for name, t in module.state_dict().items():
        assert torch.equal(t, ref[name])


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("piece_bytes", 3 * 1024**3),  # past what one read call moves (~2 GiB)
        ("slot_bytes", 0),
        ("batch_bytes", -1),
        ("slots", -2),
        ("workers", -1),
        ("remote_inflight", 0),
        ("views", "all"),
        ("uneven", "pad"),
    ],
)
def test_an_option_out_of_range_is_refused_naming_it(ckpt: Path, field: str, value: object) -> None:
    """``LoaderOptions`` was taken as given: a piece or slot past the ~2 GiB one read call moves
    read as a truncated file, a zero slot looped; each is now a ``LoaderError`` naming the field
    before anything is read."""
    from modelpack.errors import LoaderError

    opts = dataclasses.replace(LoaderOptions(), **{field: value})
    with pytest.raises(LoaderError, match=f"LoaderOptions.{field}"):
        load_state_dict(str(ckpt), allow_unverified=True, options=opts)
