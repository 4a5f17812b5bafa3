"""Where the engine's own ``load_weights`` puts each checkpoint tensor, so a read lands there.

A streamed (or hashed) load has to read every byte into memory; without this, it reads into
fresh full-shape tensors, and vLLM's weight loaders then copy each into its parameter: two passes
over fresh memory (the second one plus the page faults of the first). The mapping from a
checkpoint name to parameter memory is model code (stacked q/k/v and gate/up, vocab padding,
renamed prefixes), so it is not restated here: the model's own ``load_weights`` is run once on
data-less ``meta`` tensors under a dispatch mode that records, in order, every write it makes
and skips them all. A checkpoint tensor whose bytes it copies exactly once, whole and unchanged
(same dtype, contiguous), into a parameter or buffer region that nothing else writes, is then read
straight into that region (on a GPU: the load runs on the parameters' device and the loader's
device seam copies each verified block from its pinned staging slot into the region, one pass); vLLM's real ``load_weights`` runs unchanged over the same names, and
its ``copy_`` of that tensor onto itself returns at once (PyTorch skips a copy between two views
of the same data). Every other tensor takes the copy path.

Why this is safe (docs/security.md, "Engine parameters as read destinations"):

- the dry run executes no write and no operation on tensor data: any operation on a checkpoint
  tensor other than a view or the source of a ``copy_`` aborts it, and the load takes the copy
  path for every tensor (``ParameterDestinations.reason`` says why);
- a destination must lie in the storage of one of the model's own parameters or buffers (this
  object holds it, so it cannot be freed or reused), and may not overlap any other write of the
  dry run, nor another destination;
- the bytes a read puts there are verified (chunk table or layer digest) before the loader
  yields the tensor; a failed check raises out of ``load_weights`` and the engine never serves.
  Unverified bytes may sit in a parameter of a model whose start then fails, never in one that
  serves;
- whatever the engine then does, the tensor it receives holds the checkpoint's bytes, so a
  mapping that does not match the real run costs a copy, never a wrong weight.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from modelpack.loader import ReadPlan
from modelpack.loader.dtypes import torch_dtype

_COPY = torch.ops.aten.copy_.default


class _NotDirect(Exception):
    """The dry run met an operation it cannot account for: no destination is trusted."""


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes a (possibly strided) tensor can touch, [first, end)."""
    if t.numel() == 0:
        return (t.data_ptr(), t.data_ptr())
    reach = sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride(), strict=True))
    return (t.data_ptr(), t.data_ptr() + (reach + 1) * t.element_size())


@dataclass
class _DryRun(TorchDispatchMode):
    """Records ``copy_`` from a checkpoint (meta) tensor and every other write; executes neither."""

    names: dict[int, str]  # id of a checkpoint meta tensor -> its name
    copies: dict[str, list[torch.Tensor]] = field(default_factory=dict)  # name -> destinations
    writes: list[tuple[int, int, str | None]] = field(default_factory=list)  # (start, end, name)

    def __post_init__(self) -> None:
        super().__init__()

    def _origin(self, t: torch.Tensor) -> str | None:
        base = t._base if t._base is not None else t
        return self.names.get(id(base))

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        metas = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.is_meta]
        if func is _COPY and not args[0].is_meta and args[1].is_meta:  # copy_(dst, src[, non_blocking])
            dst, src = args[0], args[1]
            name = self._origin(src)
            if name is None:
                raise _NotDirect(f"a copy from a meta tensor that is no checkpoint tensor ({func})")
            whole = src._base if src._base is not None else src
            exact = (
                src.storage_offset() == 0
                and src.numel() == whole.numel()
                and src.is_contiguous()
                and dst.is_contiguous()
                and src.dtype == dst.dtype
                and tuple(src.shape) == tuple(dst.shape)
            )
            # a partial, strided or converting copy is still a write: it fences its region
            self.copies.setdefault(name if exact else f"\0{name}", []).append(dst)
            self.writes.append((*_span(dst), name if exact else None))
            return dst
        if func.is_view:
            return func(*args, **kwargs)
        if metas:
            raise _NotDirect(f"{func} on a checkpoint tensor")
        if func._schema.is_mutable:
            written = [
                a
                for arg, a in zip(func._schema.arguments, args, strict=False)
                if arg.alias_info is not None and arg.alias_info.is_write and isinstance(a, torch.Tensor)
            ]
            for w in written:
                self.writes.append((*_span(w), None))
            if len(written) != 1 or len(func._schema.returns) != 1:
                raise _NotDirect(f"{func}: a write the dry run cannot stand in for")
            return written[0]
        return func(*args, **kwargs)


@dataclass
class ParameterDestinations:
    """Checkpoint name → the region of the engine's parameter memory its bytes end up in."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    reason: str = ""  # why not every tensor of the plan has one ("" when all do)

    @property
    def device(self) -> torch.device | None:
        """Where every destination lies (the parameters' device; ``None`` when there is none):
        the load runs on it, so a streamed chunk goes pinned slot → parameter region in one copy
        through the loader's device seam (``loader/device_copier.py``)."""
        return next(iter(self.tensors.values())).device if self.tensors else None

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    @classmethod
    def trace(cls, model: torch.nn.Module, plan: ReadPlan) -> ParameterDestinations:
        """Run the model's ``load_weights`` over the plan's whole tensors as ``meta`` tensors."""
        metas: dict[str, torch.Tensor] = {}
        for t in plan.tensors:
            if t.sharded:  # this rank reads a slice: the copy path narrows the full tensor
                continue
            metas[t.name] = torch.empty(
                t.full_shape, dtype=torch_dtype(t.dtype, where=f"{t.file}: {t.name}"), device="meta"
            )
        if not metas:
            return cls(reason="no tensor of this plan is read whole")
        run = _DryRun({id(m): n for n, m in metas.items()})
        try:
            with torch.no_grad(), run:
                cast(Any, model).load_weights(iter(metas.items()))
        except _NotDirect as exc:
            return cls(reason=f"dry run of load_weights stopped: {exc}")
        except Exception as exc:  # model code we do not control: the copy path, and why
            return cls(reason=f"dry run of load_weights failed: {type(exc).__name__}: {exc}"[:500])
        return cls._choose(model, metas, run)

    @classmethod
    def _choose(
        cls, model: torch.nn.Module, metas: Mapping[str, torch.Tensor], run: _DryRun
    ) -> ParameterDestinations:
        owned = {
            t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers()) if not t.is_meta
        }
        fenced = _overlapping(run.writes)
        chosen: dict[str, torch.Tensor] = {}
        skipped: list[str] = []
        for name, meta in metas.items():
            dsts = run.copies.get(name, [])
            if (
                len(dsts) != 1  # never copied, or copied to two places
                or f"\0{name}" in run.copies  # also copied in part, strided or converted
                or dsts[0].untyped_storage().data_ptr() not in owned  # not into the model's own memory
                or name in fenced  # another write touches its region
            ):
                skipped.append(name)
                continue
            chosen[name] = dsts[0].view(meta.shape)
        devices = {str(t.device) for t in chosen.values()}
        if len(devices) > 1:  # one load runs on one device: parameters spread over several take the copy
            return cls(
                reason=f"the destinations lie on {len(devices)} devices ({', '.join(sorted(devices))})"
            )
        reason = ""
        if skipped:
            reason = f"{len(skipped)} tensor(s) take the copy path (not one whole, exclusive copy): "
            reason += ", ".join(sorted(skipped)[:8]) + (" …" if len(skipped) > 8 else "")
        return cls(chosen, reason)


def _overlapping(writes: list[tuple[int, int, str | None]]) -> set[str]:
    """Names of the exact copies whose region another write overlaps (one sweep by start)."""
    spans = sorted((w for w in writes if w[0] < w[1]), key=lambda w: (w[0], w[1]))  # never by name
    fenced: set[str] = set()
    reach = -1  # the furthest end of the spans before this one
    for i, (start, end, name) in enumerate(spans):
        if name is not None and (reach > start or (i + 1 < len(spans) and spans[i + 1][0] < end)):
            fenced.add(name)
        reach = max(reach, end)
    return fenced
