"""A sequence-parallel layout as the resolver sees it (issue 24).

:class:`SequenceLayout` is a fact about one call site, like its head size: how
its sequence is split across ranks. It rides on the layer's
:class:`~attnres.LayerSpec` (``layout``, written to a trace only when set), so
every resolution of the layer -- its first, a cast, a request's, the training
one -- checks the per-rank kernel against it (``Check.LAYOUT`` in
:mod:`attnres.machine`):

- ``ring > 1``: partial results are merged with their softmax log-sum-exp, so
  the kernel must be able to return it (``BackendSpec.lse``);
- ``ulysses > 1``: each rank runs ``num_heads / ulysses`` query heads and
  ``num_kv_heads / ulysses`` key/value heads, so both must divide.

The process group and the collectives are :mod:`attnres.parallel`'s; this
module imports neither torch nor the distributed package, so plans for a
simulated platform use it freely.
"""

from __future__ import annotations

import operator
from typing import Any, Final

from attrs import field, frozen

from attnres.errors import InvalidArgumentError, SequenceParallelArgumentError

__all__ = [
    "LAYOUT_KINDS",
    "MAX_DEGREE",
    "MAX_HEADS",
    "MAX_PAD_COST",
    "SequenceLayout",
    "context_parallel_layout",
    "padded_heads",
]

#: The component kinds whose layers take a pipeline-wide layout (``attnres plan
#: --ulysses-degree/--ring-degree``): the denoiser, whose sequence is what outgrows
#: one device (SGLang's USPAttention, xDiT, diffusers' context parallelism all
#: shard it). Every other kind runs replicated, without a layout: text and image
#: encoders, and VAE attention, which opts out (SGLang's ``skip_sequence_parallel``).
LAYOUT_KINDS: Final = frozenset({"transformer"})


#: The most ranks one layout degree spans, and the most heads a layer declares:
#: bounded where they are parsed (the API, the command line, a trace), so that
#: every trace attnres writes reads back (issue 32 item 15) and no message has to
#: print a number Python refuses to convert.
MAX_DEGREE: Final = 1 << 16
MAX_HEADS: Final = 1 << 16


def _bounded(value: Any, what: str, limit: int, unit: str = "") -> int:
    """``value`` as an int in 1..``limit``, else a
    :class:`~attnres.errors.SequenceParallelArgumentError` (a ``ValueError``)
    naming ``what`` was asked and the bound (issue 32 items 11, 16)."""
    if not isinstance(value, bool):
        try:
            number = operator.index(value)
        except TypeError:
            pass
        else:
            if 1 <= number <= limit:
                return number
            if number > limit:
                shown = (
                    str(number) if number < 10**30 else f"a number of {number.bit_length()} bits"
                )
                raise SequenceParallelArgumentError(
                    f"{what}: must be at most {limit}{unit}, got {shown}", what, limit
                )
    shown = repr(value) if not isinstance(value, int) or abs(value) < 10**30 else "a huge number"
    raise SequenceParallelArgumentError(
        f"{what}: expected a positive integer (1 to {limit}{unit}), got {shown}", what, limit
    )


def _degree(value: Any, what: str = "degree") -> int:
    return _bounded(value, what, MAX_DEGREE, " ranks")


def _heads(value: Any, what: str = "heads") -> int | None:
    return None if value is None else _bounded(value, what, MAX_HEADS)


def _ulysses(value: Any) -> int:
    return _degree(value, "ulysses degree")


def _ring(value: Any) -> int:
    return _degree(value, "ring degree")


def _allgather(value: Any) -> int:
    return _degree(value, "allgather degree")


def _num_heads(value: Any) -> int | None:
    return _heads(value, "num_heads")


def _num_kv_heads(value: Any) -> int | None:
    return _heads(value, "num_kv_heads")


def _text(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise InvalidArgumentError(f"expected a string or None, got {value!r}")


#: Issue 35: the most work head padding may add (padded heads / real heads) before
#: the layout check refuses it (``padding_too_costly``): at 2x, half of every
#: rank's attention would be spent on zeros, where a ring or AllGather-KV layout
#: does the same job with none wasted. vLLM-Omni measured 14.3% for 14 heads
#: padded to 16 (vllm-omni#7641).
MAX_PAD_COST: Final = 2.0


def padded_heads(heads: int, kv_heads: int, ulysses: int) -> tuple[int, int]:
    """Issue 35: (query heads, key/value heads) after zero-padding both to a
    multiple of ``ulysses``, keeping every query head with its key/value group:
    the key/value heads grow to the next multiple of ``ulysses`` and the query
    heads to as many groups (a padded query head meets only padded key/value
    heads, so the real heads' results are unchanged)."""
    group = heads // kv_heads
    kv = -(-kv_heads // ulysses) * ulysses
    q = kv * group
    if q % ulysses:  # cannot happen (kv divides); kept as the invariant's statement
        raise InvalidArgumentError(f"padded heads {q} do not divide by {ulysses}")
    return q, kv


def _kv_heads(layout: Any, attribute: Any, value: int | None) -> None:
    heads = layout.num_heads
    if value is not None and heads is not None and (value > heads or heads % value):
        raise SequenceParallelArgumentError(
            f"num_kv_heads: {value} key/value heads for {heads} query heads; each key/value "
            f"head serves a whole group of query heads, so they must divide num_heads "
            f"(swapped --heads and --kv-heads?)",
            "num_kv_heads",
            heads,
        )


@frozen(cache_hash=True)
class SequenceLayout:
    """How one layer's sequence is split: ``ulysses * ring`` ranks.

    ``ulysses``: ranks that exchange heads for sequence with an all-to-all
    (each then attends over the whole sequence with a share of the heads);
    ``ring``: ranks that pass key/value blocks around a ring and merge partial
    results by their log-sum-exp. ``num_heads`` and ``num_kv_heads`` are the
    layer's head counts when known (a plan from a pipeline file may not know
    them; the Ulysses divisibility check then says so).
    """

    ulysses: int = field(default=1, converter=_ulysses)
    ring: int = field(default=1, converter=_ring)
    num_heads: int | None = field(default=None, converter=_num_heads)
    num_kv_heads: int | None = field(default=None, converter=_num_kv_heads, validator=_kv_heads)
    #: issue 35: ranks that all-gather key/value blocks (each keeps its query
    #: shard; vLLM-Omni's AllGather-KV, SGLang's kv-gather degree); composes with
    #: Ulysses inside (vllm-omni#7641), not with a ring (both split the rows)
    allgather: int = field(default=1, converter=_allgather, metadata={"omit_default": True})
    #: issue 35: Ulysses zero-pads the heads to a multiple of its degree and drops
    #: the padding after (vLLM-Omni's ``advanced_uaa``)
    pad_heads: bool = field(default=False, metadata={"omit_default": True})
    #: issue 35: a layout chosen by ``SequenceParallel(layout="auto")``: the rule
    #: that chose it (``attnres.machine.LAYOUT_RULES``) and why, with the facts read
    rule: str | None = field(default=None, converter=_text, metadata={"omit_default": True})
    why: str | None = field(default=None, converter=_text, metadata={"omit_default": True})

    def __attrs_post_init__(self) -> None:
        if self.allgather > 1 and self.ring > 1:
            raise SequenceParallelArgumentError(
                f"allgather={self.allgather} and ring={self.ring}: both split the query rows "
                f"across ranks, so they do not compose; choose one (Ulysses composes with "
                f"either)",
                "allgather x ring",
                "one of them 1",
            )
        if not isinstance(self.pad_heads, bool):
            raise SequenceParallelArgumentError(
                f"pad_heads: expected a bool, got {self.pad_heads!r}", "pad_heads", "a bool"
            )

    @property
    def degree(self) -> int:
        """How many ranks the layout spans (``ulysses * ring * allgather``)."""
        return self.ulysses * self.ring * self.allgather

    @property
    def outer(self) -> int:
        """The degree outside Ulysses: the ring's or the all-gather's."""
        return self.ring * self.allgather

    @property
    def kind(self) -> str:
        """Issue 35: the layout kind, in words (``allgather_kv``, ``padded_ulysses``,
        ``usp``, ``ulysses``, ``ring``, ``replicated``)."""
        if self.allgather > 1:
            return "allgather_kv"
        if self.pad_heads:
            return "padded_ulysses"
        if self.ulysses > 1 and self.ring > 1:
            return "usp"
        return "ulysses" if self.ulysses > 1 else ("ring" if self.ring > 1 else "replicated")

    def padding(self) -> tuple[int, int] | None:
        """(query heads, key/value heads) after padding; ``None`` without padding or
        head counts."""
        if not self.pad_heads or self.num_heads is None:
            return None
        kv = self.num_heads if self.num_kv_heads is None else self.num_kv_heads
        return padded_heads(self.num_heads, kv, self.ulysses)

    def pad_cost(self) -> float | None:
        """The attention work padding adds: padded query heads / real ones (1.0: none)."""
        padded = self.padding()
        return None if padded is None or self.num_heads is None else padded[0] / self.num_heads

    @property
    def needs_lse(self) -> bool:
        """Whether partial results are merged by their log-sum-exp (a ring)."""
        return self.ring > 1

    def rank_heads(self) -> tuple[int, int] | None:
        """(query heads, key/value heads) one rank runs; ``None`` when unknown or
        not divisible by ``ulysses``."""
        heads = self.num_heads
        kv = heads if self.num_kv_heads is None else self.num_kv_heads
        padded = self.padding()
        if padded is not None:
            heads, kv = padded
        if heads is None or kv is None or heads % self.ulysses or kv % self.ulysses:
            return None
        return heads // self.ulysses, kv // self.ulysses

    def describe(self) -> str:
        """``ulysses=2 x ring=2`` (and the per-rank heads when known)."""
        text = self.ulysses_ring()
        per_rank = self.rank_heads()
        if per_rank is not None and self.ulysses > 1:
            text += f" ({per_rank[0]} heads, {per_rank[1]} kv heads per rank)"
        cost = self.pad_cost()
        if cost is not None:
            text += f", heads padded: +{cost - 1:.1%} attention work"
        if self.rule is not None:
            text += f", chosen by rule {self.rule}"
        return text

    def per_rank(self, backend: str | None) -> str:
        """What each rank runs under this layout, in words (plans and explanations)."""
        what = f"{self.degree} ranks ({self.ulysses_ring()})"
        if backend is None:
            return f"{what}: no kernel can serve the layout (see the layout check)"
        heads = self.rank_heads()
        if self.ulysses == 1 or self.num_heads is None:
            share = "every head" if self.ulysses == 1 else f"1/{self.ulysses} of the heads"
        elif heads is None:
            share = f"1/{self.ulysses} of the heads (which do not divide)"
        else:
            kv = self.num_kv_heads or self.num_heads
            share = f"{heads[0]} of {self.num_heads} heads ({heads[1]} of {kv} kv heads)"
        text = f"{what}: each runs {backend} on {share} and 1/{self.degree} of the sequence"
        if self.ulysses > 1:
            text += f"; an all-to-all over {self.ulysses} ranks trades sequence for heads"
        if self.ring > 1:
            text += (
                f"; a ring of {self.ring} passes key/value blocks and merges them by their "
                f"log-sum-exp"
            )
        if self.allgather > 1:
            text += (
                f"; {self.allgather} ranks all-gather every key/value block and each attends "
                f"with its own query shard"
            )
        padded = self.padding()
        if padded is not None and self.num_heads is not None:
            cost = self.pad_cost() or 1.0
            text += (
                f"; heads zero-padded from {self.num_heads} to {padded[0]} (kv "
                f"{self.num_kv_heads or self.num_heads} to {padded[1]}) and dropped after: "
                f"+{cost - 1:.1%} attention work"
            )
        elif self.pad_heads:
            text += "; heads zero-padded to a multiple of the Ulysses degree (cost unknown)"
        if self.rule is not None:
            text += f"; chosen by rule {self.rule}: {self.why}"
        return text

    def ulysses_ring(self) -> str:
        text = f"ulysses={self.ulysses} x ring={self.ring}"
        if self.allgather > 1:
            text += f" x allgather={self.allgather}"
        if self.pad_heads:
            text += " (padded heads)"
        return text


def context_parallel_layout(
    model: Any, num_heads: int | None = None, num_kv_heads: int | None = None
) -> SequenceLayout | None:
    """The layout diffusers' context parallelism gives ``model``'s attention, or ``None``.

    Read from what the model carries, not from a list of classes: diffusers'
    ``ModelMixin.enable_parallelism`` records a ``ParallelConfig`` as
    ``model._parallel_config`` (and on each attention processor), whose
    ``context_parallel_config`` has ``ulysses_degree`` and ``ring_degree`` (``None``
    means 1) -- checked against diffusers 0.42.1, ``models/_modeling_parallel.py``
    and ``models/modeling_utils.py``. Its ring merges partial results by their
    log-sum-exp too, so the same layout check applies. With ``ulysses_anything``
    diffusers handles heads that do not divide, so the head counts are left out.
    """
    config = getattr(model, "_parallel_config", None)
    cp = getattr(config, "context_parallel_config", None)
    if cp is None:
        return None
    ulysses = getattr(cp, "ulysses_degree", None) or 1
    ring = getattr(cp, "ring_degree", None) or 1
    if ulysses * ring == 1:
        return None
    if getattr(cp, "ulysses_anything", False):
        num_heads = num_kv_heads = None
    return SequenceLayout(ulysses, ring, num_heads, num_kv_heads)


#: bytes per element of the dtypes a plan names (the gathered K/V memory fact)
