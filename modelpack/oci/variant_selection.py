"""Which entry of a variant index a node takes: one small object, the same for every caller.

``pull``, ``load``, the vLLM load format and the KServe initializer all build a
:class:`VariantSelector` from what they know about the node and what the caller asked for, and
call :meth:`VariantSelector.select`. Like a sigstore-python policy it returns reasons: a
:class:`Selection` that says why the chosen entry fits and why each other entry does not, or a
``VariantSelectionError`` carrying the same per-entry reasons. It FAILS CLOSED:

* every ``--variant KEY=VALUE`` the caller gives must be declared by the entry with exactly that
  value (an entry that does not declare the field does not fit);
* the node's facts constrain the fields an entry declares: ``accelerator`` must fit the node's
  device arch by the prefix rule of ``modelpack.mediatypes.variants.accelerator_fits``; ``tp-size``
  must equal the node's TP size (1 unless the engine or ``--tp-size`` says otherwise); ``engine``
  must equal the caller's engine, and an entry for an engine fits no caller that names none;
* ``layout=sharded_state`` without ``tp-size`` never fits (its per-rank files are for some TP
  size the entry does not say);
* a field an entry does not declare, and the caller did not ask for, fits anything.

Several entries fitting: the MOST SPECIFIC wins — the one that declares (and so matched) the most
of the constrained fields (requested fields plus ``accelerator``, ``tp-size``, ``engine``), then
the one whose accelerator names more ``-`` parts (``cuda-sm_90`` over ``cuda``). Equal on both is
a tie: a refusal naming the tied entries, never a pick by position.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from modelpack.errors import VariantIndexError, VariantSelectionError
from modelpack.mediatypes.variants import (
    LAYOUT_SHARDED_STATE,
    VARIANT_KEYS,
    accelerator_fits,
    accelerator_specificity,
    check_variant_value,
    normalize_precision,
)
from modelpack.oci.variant_index import VariantEntry, VariantIndex


def parse_variant_options(items: Sequence[str] | Mapping[str, str]) -> dict[str, str]:
    """``("precision=bf16", "tp-size=2")`` (the CLI's repeated ``--variant``) or a mapping →
    ``{"precision": "bf16", "tp-size": "2"}``; unknown fields and malformed values refused."""
    pairs: list[tuple[str, str]] = []
    if isinstance(items, Mapping):
        pairs = [(str(k), str(v)) for k, v in items.items()]
    else:
        for item in items:
            key, sep, value = item.partition("=")
            if not sep:
                raise VariantIndexError(f"--variant {item!r}: write KEY=VALUE (e.g. precision=bf16)")
            pairs.append((key.strip(), value.strip()))
    out: dict[str, str] = {}
    for key, value in pairs:
        short = key[len("dev.modelpack.variant.") :] if key.startswith("dev.modelpack.variant.") else key
        if short not in VARIANT_KEYS:
            raise VariantIndexError(f"--variant {key}: unknown field; known are {', '.join(VARIANT_KEYS)}")
        if short in out and out[short] != value:
            raise VariantIndexError(f"--variant {short}: given twice ({out[short]!r}, {value!r})")
        if short == "precision":
            value = normalize_precision(value)
        out[short] = check_variant_value(short, value, where=f"--variant {short}")
    return out


@dataclass(frozen=True)
class EntryVerdict:
    """One entry against this node: ``mismatches`` empty means it fits; ``matched`` names the
    constrained fields it declared and matched (its specificity)."""

    entry: VariantEntry
    mismatches: tuple[str, ...]
    matched: tuple[str, ...]
    accelerator_parts: int

    @property
    def fits(self) -> bool:
        return not self.mismatches

    @property
    def specificity(self) -> tuple[int, int]:
        return (len(self.matched), self.accelerator_parts)

    def to_json(self) -> dict[str, object]:
        return {
            **self.entry.to_json(),
            "fits": self.fits,
            "mismatches": list(self.mismatches),
            "matched": list(self.matched),
        }


@dataclass(frozen=True)
class Selection:
    """The chosen entry and every entry's verdict (why the others lost)."""

    index_digest: str
    chosen: VariantEntry
    verdicts: tuple[EntryVerdict, ...]
    node: Mapping[str, str] = field(default_factory=dict)
    requested: Mapping[str, str] = field(default_factory=dict)

    @property
    def digest(self) -> str:
        return str(self.chosen.descriptor.digest)

    def to_json(self) -> dict[str, object]:
        return {
            "index": self.index_digest,
            "chosen": self.digest,
            "variant": dict(self.chosen.fields),
            "requested": dict(self.requested),
            "node": dict(self.node),
            "entries": [v.to_json() for v in self.verdicts],
        }


@dataclass
class VariantSelector:
    """What the node is and what the caller asked for.

    ``accelerator`` is the node's device arch (``loader.fingerprint.device_arch``), or a callable
    giving it, called only when an index is actually met (so a plain manifest pull never imports
    torch). ``tp_size`` is the engine's tensor-parallel size; ``engine`` the serving engine's name
    (None: the caller names none, and entries for an engine do not fit it).
    """

    requested: dict[str, str] = field(default_factory=dict)
    accelerator: str | Callable[[], str] | None = None
    tp_size: int = 1
    engine: str | None = None

    @classmethod
    def from_options(
        cls,
        variant: Sequence[str] | Mapping[str, str] = (),
        *,
        accelerator: str | Callable[[], str] | None = None,
        tp_size: int | None = None,
        engine: str | None = None,
    ) -> VariantSelector:
        return cls(parse_variant_options(variant), accelerator, int(tp_size or 1), engine)

    def node_facts(self) -> dict[str, str]:
        acc = self.accelerator() if callable(self.accelerator) else self.accelerator
        self.accelerator = acc  # computed once
        facts = {"tp-size": str(self.tp_size)}
        if acc:
            facts["accelerator"] = acc
        if self.engine:
            facts["engine"] = self.engine
        return facts

    def judge(self, entry: VariantEntry, facts: Mapping[str, str]) -> EntryVerdict:
        mismatches: list[str] = []
        matched: list[str] = []
        declared = entry.fields
        for short, wanted in self.requested.items():
            have = declared.get(short)
            if have is None:
                mismatches.append(f"{short}: wanted {wanted}, entry declares none")
            elif have != wanted:
                mismatches.append(f"{short}: wanted {wanted}, entry has {have}")
            else:
                matched.append(short)
        acc = declared.get("accelerator")
        if acc is not None and "accelerator" not in self.requested:
            node_acc = facts.get("accelerator", "")
            if not node_acc:
                mismatches.append(f"accelerator: entry is for {acc}, this node's device arch is not known")
            elif not accelerator_fits(acc, node_acc):
                mismatches.append(f"accelerator: entry is for {acc}, this node is {node_acc}")
            else:
                matched.append("accelerator")
        tp = declared.get("tp-size")
        if declared.get("layout") == LAYOUT_SHARDED_STATE and tp is None:
            mismatches.append("layout: sharded_state without a tp-size")
        if tp is not None and "tp-size" not in self.requested:
            if tp != facts["tp-size"]:
                mismatches.append(f"tp-size: entry is for {tp}, this node runs {facts['tp-size']}")
            else:
                matched.append("tp-size")
        engine = declared.get("engine")
        if engine is not None and "engine" not in self.requested:
            node_engine = facts.get("engine")
            if node_engine is None:
                mismatches.append(f"engine: entry is for {engine}, the caller names no engine")
            elif engine != node_engine:
                mismatches.append(f"engine: entry is for {engine}, the caller is {node_engine}")
            else:
                matched.append("engine")
        parts = accelerator_specificity(acc) if acc and "accelerator" in matched else 0
        return EntryVerdict(entry, tuple(mismatches), tuple(matched), parts)

    def select(self, index: VariantIndex) -> Selection:
        """The one entry that fits best; VariantSelectionError when none or several tie."""
        facts = self.node_facts()
        verdicts = tuple(self.judge(e, facts) for e in index.entries)
        fitting = [v for v in verdicts if v.fits]
        asked = ", ".join(f"{k}={v}" for k, v in sorted(self.requested.items())) or "nothing"
        node = ", ".join(f"{k}={v}" for k, v in sorted(facts.items()))
        if not fitting:
            reasons = {v.entry.label: list(v.mismatches) for v in verdicts}
            lines = "; ".join(f"{label}: {', '.join(why)}" for label, why in reasons.items())
            raise VariantSelectionError(
                f"index {index.digest}: no variant fits (asked {asked}; node {node}): {lines}",
                index=index.digest,
                reasons=reasons,
            )
        best = max(v.specificity for v in fitting)
        top = [v for v in fitting if v.specificity == best]
        if len(top) > 1:
            names = [v.entry.label for v in top]
            shown = "; ".join(
                f"{v.entry.label} ({', '.join(f'{k}={x}' for k, x in sorted(v.entry.fields.items())) or 'no fields'})"
                for v in top
            )
            raise VariantSelectionError(
                f"index {index.digest}: {len(top)} variants fit equally (asked {asked}; node {node}): "
                f"{shown}; choose one with --variant KEY=VALUE",
                index=index.digest,
                candidates=names,
            )
        return Selection(index.digest, top[0].entry, verdicts, facts, dict(self.requested))
