"""Key padding through varlen kernels: classify a mask, unpad, run, pad back (issue 22).

A kernel with no mask argument (flash-attn, FA3, SageAttention) can still serve
a layer whose mask is *key padding* -- per batch row, which key positions are
valid -- by running its varlen entry point on the valid tokens only:

1. :func:`observe_mask` classifies the mask a call brings (docs/masks.md):
   ``key_padding`` when every head and query of a row sees the same keys
   (right padding, left padding, or any other set: Qwen-Image's joint
   ``[text, image]`` mask has its padding in the middle), ``causal with key
   padding`` when the mask is that times a top-left causal triangle,
   ``boolean`` or ``additive`` otherwise. Packing keeps the order of the
   tokens, so causal attention over the packed sequence is causal attention
   over the valid tokens, whatever the pattern;
2. :func:`unpad` packs the valid tokens into ``(total, heads, head_size)``
   with int32 ``cu_seqlens`` (the layout ``flash_attn_varlen_func`` and
   ``sageattn_varlen`` take);
3. the varlen kernel runs on the packed tokens;
4. :func:`pad` scatters the output back to ``(batch, seq, heads, head_size)``.

The span route: a kernel whose varlen function takes ``seqused_q`` and
``seqused_k`` (FA3, FA4; its adapter says so: ``takes_seqused``) is handed,
where every row's valid tokens are one run, the batch flattened as it lies,
``cu_seqlens`` at each run's first token and ``seqused`` its length
(:class:`Spans`): steps 2 and 4 disappear, and only the output rows no
sequence covers are zeroed. Not taken when a gradient is needed (those
kernels' backward leaves the uncovered rows of dq/dk/dv unwritten).

Padded rows: a mask every query shares (``[B, 1, 1, S]`` key padding) does
not say which queries are padding -- cross-attention of equal lengths passes
one too -- so only the keys are unpadded and every query of a row is
computed, as SDPA computes it. Where the mask ties query i to key i
(self-attention masks whose padded queries see nothing or only the first
token, and causal masks) the queries are unpadded with the keys, so a padded
query position comes back as **zeros** (the untouched model computes
attention over whatever that position's mask row allows; a model that masks
its keys never reads those rows as keys again). A batch row whose keys are
all padding is **zeros** on both (torch SDPA gives NaN there); it is left out
of ``cu_seqlens``, so no kernel is handed a sequence of length 0.

The route is a kernel of the usual calling convention
(:func:`padded_kernel`), so ``attnres.Attention`` and the integrations' routes
run it like any other kernel. Only tensor methods run per call.

The classification and the packing indices are computed once per mask: one
forward hands the same mask tensor to every layer, and each of those layers
would otherwise classify it again and rebuild the same indices (on a GPU,
several host synchronisations per layer: ``nonzero``, the longest length, the
classifier's checks). :func:`mask_plan` keeps them keyed on the mask tensor's
identity and its version counter (bumped by every in-place change through
torch), for a few masks at a time; its one invalidation is that check, and
:func:`clear_varlen_cache` empties it with the varlen adapters.
"""

from __future__ import annotations

import importlib
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, NamedTuple

from attnres._memo import GenerationMemo
from attnres._vocab import CausalAlignment, MaskKind, MaskRoute
from attnres.backends import BackendSpec, KernelFacts, OptionValue, entry_point_options
from attnres.errors import (
    BackendOptionError,
    InvalidArgumentError,
    KernelUnavailableError,
    MaskKindError,
    MaskShapeError,
)
from attnres.kernels._common import no_keys_output

if TYPE_CHECKING:
    from torch import Tensor

    from attnres.kernels import KernelFn, VarlenKernelFn
    from attnres.layer import LayerSpec
    from attnres.platform import Platform

__all__ = [
    "MASKED_AT",
    "MaskKindError",
    "MaskPlan",
    "ObservedMask",
    "Packing",
    "Spans",
    "Unpadded",
    "check_layer_options",
    "check_route_options",
    "get_varlen_kernel",
    "is_prefix",
    "mask_plan",
    "observe_mask",
    "pack",
    "packing",
    "pad",
    "padded_kernel",
    "refuse_integer_mask",
    "route_kernel",
    "unpad",
]


class ObservedMask(NamedTuple):
    """What :func:`observe_mask` found in one call's mask."""

    #: ``none``, ``key_padding``, ``boolean`` or ``additive``
    kind: MaskKind
    #: the mask also holds a top-left causal triangle (key padding only)
    causal: bool
    #: (batch, seq_kv) booleans, True where a key takes part (key padding only)
    valid: Tensor | None
    #: why a mask that looks like padding is not key padding ('' otherwise)
    detail: str = ""
    #: self-attention whose mask marks the padded queries (their rows are not the
    #: valid keys: none, or the first token): the route drops those queries. A mask
    #: every query shares does not tell a padded query from a valid one (it may be
    #: cross-attention of equal lengths), so every query is computed
    marks_queries: bool = False

    @property
    def words(self) -> str:
        """The observed kind as the vocabulary says it (``causal with key padding``)."""
        base = {
            MaskKind.NONE: "none",
            MaskKind.KEY_PADDING: "key padding",
            MaskKind.BOOLEAN: "boolean mask",
            MaskKind.ADDITIVE: "additive mask",
            MaskKind.ANY: "boolean or additive mask",
        }[self.kind]
        return f"causal with {base}" if self.causal else base


#: A float mask value at or below this masks its key: exp(-10000 + s) underflows
#: to exactly 0 next to any score within ~9900 of the row's largest (fp32
#: softmax), so such a bias is padding in all but a fully masked row.
MASKED_AT = -10000.0


def _keep(mask: Tensor) -> Tensor | None:
    """The boolean "takes part" form of a mask, or ``None`` for a true additive bias.

    A float mask is padding-like when every value is 0 (takes part) or a
    "masked" value at or below :data:`MASKED_AT` (-inf; transformers writes
    ``torch.finfo(dtype).min``; diffusers' LTX and older transformers code
    ``-10000.0``).
    """
    if not mask.is_floating_point():
        return mask.bool()
    keep = mask == 0
    masked = mask <= MASKED_AT
    if not _all(keep | masked):
        return None
    return keep


def _all(x: Tensor) -> bool:
    """``bool(x.all())`` for a boolean tensor, read through its bytes: a min
    reduction, several times faster than ``all`` on the CPU (a (4, 512, 512)
    mask: ~40 us against ~760 us)."""
    import torch

    return x.numel() == 0 or bool(x.view(torch.uint8).min())


def _any_over(x: Tensor, dim: int) -> Tensor:
    """``x.any(dim=dim)`` for a boolean tensor, through its bytes (as :func:`_all`)."""
    import torch

    if x.shape[dim] == 0:
        return x.any(dim=dim)
    return x.view(torch.uint8).amax(dim=dim).bool()


def _rows_equal(rows: Tensor, pattern: Tensor) -> Tensor:
    """(batch, seq_q): whether each query's row of ``rows`` (batch, seq_q, seq_kv)
    is ``pattern``'s (broadcast), through bytes (as :func:`_all`)."""
    import torch

    equal = rows == pattern
    if equal.shape[-1] == 0:
        return equal.all(dim=-1)
    return equal.view(torch.uint8).amin(dim=-1).bool()


def refuse_integer_mask(mask: Any) -> None:
    """A :class:`MaskKindError` for a mask tensor that is neither boolean nor float.

    Masks follow torch's ``scaled_dot_product_attention``, which takes a boolean
    mask (True: takes part) or a float one (added to the scores) and refuses an
    integer one. An integer mask meant three things before (issue 32 item 1):
    SDPA's bare error, eager and flex adding the integers (1 is then no mask),
    and the unpad route reading non-zero as "takes part" (an int64 0/-10000
    padding mask inverted); it is refused by every kernel and route alike.
    """
    dtype = getattr(mask, "dtype", None)
    if dtype is None or dtype.is_floating_point or dtype.is_complex or str(dtype) == "torch.bool":
        return
    name = str(dtype).removeprefix("torch.")
    raise MaskKindError(
        f"this call's attention mask is an integer tensor ({name}), which attnres does not "
        f"read: masks follow torch's scaled_dot_product_attention, which takes a boolean "
        f"mask (True: the key takes part) or a float mask (added to the scores). Pass "
        f"mask.bool() for a 0/1 keep mask, or mask.to(query.dtype) for an additive bias "
        f"(0 and -10000 or -inf)",
        f"integer mask ({name})",
    )


def observe_mask(mask: Tensor | None, batch: int, seq_q: int, seq_kv: int) -> ObservedMask:
    """Classify the mask of one call (SDPA semantics, broadcastable to (B, H, Sq, Skv));
    an integer mask is a :class:`MaskKindError` (:func:`refuse_integer_mask`)."""
    if mask is None:
        return ObservedMask(MaskKind.NONE, False, None)
    refuse_integer_mask(mask)
    view = mask
    while view.dim() < 4:  # SDPA broadcasting: a 2-D mask is (seq_q, seq_kv)
        view = view.unsqueeze(0)
    if view.dim() != 4:
        return ObservedMask(MaskKind.BOOLEAN, False, None, f"a {mask.dim()}-D mask")
    _check_broadcast(mask, view, batch, seq_q, seq_kv)
    keep = _keep(view)
    if keep is None:
        return ObservedMask(
            MaskKind.ADDITIVE,
            False,
            None,
            "a float bias: values other than 0 and masked ones (<= -10000)",
        )
    if keep.shape[1] == 1 and keep.shape[2] == 1:  # (B, 1, 1, Skv): padding by its shape
        return ObservedMask(MaskKind.KEY_PADDING, False, keep[:, 0, 0].expand(batch, seq_kv))
    keep = keep.expand(batch, keep.shape[1], seq_q, seq_kv)
    if keep.shape[1] != 1:
        if not _all(keep == keep[:, :1]):
            return ObservedMask(MaskKind.BOOLEAN, False, None, "the heads see different keys")
        keep = keep[:, :1]
    rows = keep[:, 0]
    valid = _any_over(rows, 1)  # (B, Skv): a key some query sees
    keys = valid[:, None, :]
    sees_the_keys = _rows_equal(rows, keys)  # (B, Sq)
    if seq_q == 1 or _all(sees_the_keys):
        return ObservedMask(MaskKind.KEY_PADDING, False, valid)
    if seq_q == seq_kv:
        # self-attention: a query at a valid position sees exactly the valid keys
        # (or those up to itself: a causal triangle folded in, as in transformers'
        # 4-D masks); a query at a padded position is dropped by the unpad route
        # (zeros), whatever its row allows: nothing (Chroma's
        # mask[:, None] * mask[:, :, None]) or the first token (HunyuanVideo's
        # token refiner). Every key such a row sees is a valid one: ``valid`` is
        # the union of the rows, and the valid queries see all of it.
        padded_query = valid.logical_not()  # query i is token i
        if _all(sees_the_keys | padded_query):
            return ObservedMask(MaskKind.KEY_PADDING, False, valid, marks_queries=True)
        tril = rows.new_ones((seq_q, seq_kv)).tril()
        if _all(_rows_equal(rows, keys & tril) | padded_query):
            return ObservedMask(MaskKind.KEY_PADDING, True, valid, marks_queries=True)
    return ObservedMask(MaskKind.BOOLEAN, False, None, "the queries of a row see different keys")


def _check_broadcast(mask: Tensor, view: Tensor, batch: int, seq_q: int, seq_kv: int) -> None:
    """A typed error, before any classification, for a mask that SDPA could not
    broadcast either (the heads dimension is the layer's: any size is left to
    the kernel)."""
    wanted = {0: ("batch", batch), 2: ("query length", seq_q), 3: ("key length", seq_kv)}
    for dim, (what, size) in wanted.items():
        if view.shape[dim] not in (1, size):
            raise MaskShapeError(
                f"this call's attention mask has shape {tuple(mask.shape)}, which does not "
                f"broadcast to (batch, heads, query length, key length) = ({batch}, heads, "
                f"{seq_q}, {seq_kv}): its {what} is {view.shape[dim]}, not 1 or {size}. Pass "
                f"a mask shaped as torch's scaled_dot_product_attention takes it, e.g. "
                f"(batch, 1, 1, key length) for key padding"
            )


def is_prefix(valid: Tensor) -> bool:
    """Whether every row's valid keys are a prefix (right padding only).

    What diffusers' dispatcher varlen backends (``flash_varlen``,
    ``sage_varlen``) assume: they take ``key[b, :valid_len]``. Qwen-Image's
    joint mask ``[text mask, image all valid]`` is key padding but not a
    prefix; attnres's own route takes any set of valid keys.
    """
    if valid.shape[1] < 2:
        return True
    return not bool((valid[:, 1:] & ~valid[:, :-1]).any())


class Packing(NamedTuple):
    """Where the valid tokens of a (batch, seq) layout go when packed."""

    indices: Tensor  # (total,) positions in the flattened (batch * seq)
    cu_seqlens: Tensor  # (sequences + 1,) int32, contiguous
    max_seqlen: int
    #: the other positions (padding), when known (with :attr:`source`)
    padded: Tensor | None = None
    #: (batch * seq,) for each position, the packed row it takes (0 at a padded
    #: one), when known: :func:`pad` then gathers the whole output in one pass and
    #: zeroes the padded rows, instead of zero-filling it and scattering into it
    #: (``index_copy_``, ~3x slower than ``index_select`` on the CPU)
    source: Tensor | None = None


class Unpadded(NamedTuple):
    """Packed tokens and the bookkeeping to put them back."""

    packed: Tensor  # (total, heads, head_size)
    indices: Tensor  # (total,) positions in the flattened (batch * seq)
    cu_seqlens: Tensor  # (sequences + 1,) int32, contiguous
    max_seqlen: int


def packing(valid: Tensor, *, with_padded: bool = False) -> Packing:
    """The packing of a (batch, seq) valid-token mask (computed once per mask).

    ``with_padded`` also lists the padded positions and each position's packed
    row (worth it where the packing is reused: :func:`mask_plan` adds them to a
    plan used a second time).
    """
    import torch

    lengths = valid.sum(dim=1, dtype=torch.int32)
    # a fully padded row leaves no sequence: no kernel is handed a length of 0
    lengths = lengths[lengths > 0]
    flat = valid.reshape(-1)
    indices = flat.nonzero().reshape(-1)
    cu = torch.zeros(lengths.shape[0] + 1, dtype=torch.int32, device=valid.device)
    torch.cumsum(lengths, dim=0, dtype=torch.int32, out=cu[1:])
    where = Packing(indices, cu, int(lengths.max()) if lengths.shape[0] else 0)
    return _with_padded(where, flat.shape[0]) if with_padded else where


def pack(x: Tensor, where: Packing) -> Tensor:
    """The valid tokens of ``x`` (batch, seq, heads, head_size), packed."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]).index_select(0, where.indices)


def unpad(x: Tensor, valid: Tensor) -> Unpadded:
    """Pack the valid tokens of ``x`` (batch, seq, heads, head_size)."""
    where = packing(valid)
    return Unpadded(pack(x, where), where.indices, where.cu_seqlens, where.max_seqlen)


def pad(packed: Tensor, where: Packing, batch: int, seq: int) -> Tensor:
    """The packed rows put back where ``where`` took them from: (batch, seq, ...),
    zeros elsewhere.

    Where the packing knows each position's packed row (:attr:`Packing.source`:
    a kept mask plan), one gather writes every row and the padded ones are
    zeroed after; otherwise (a mask used once), and where autograd records the
    call (the gather's backward would be a scatter-add), a zero-filled output
    is scattered into. Either way each row is a copy: the values are the same.
    """
    import torch

    source, padded = where.source, where.padded
    recorded = packed.requires_grad and torch.is_grad_enabled()
    # no packed rows: nothing to gather from (every position is padding)
    if source is not None and padded is not None and packed.shape[0] and not recorded:
        out = packed.index_select(0, source)
        if padded.numel():
            out.index_fill_(0, padded, 0)
    else:
        out = packed.new_zeros((batch * seq, *packed.shape[1:]))
        out.index_copy_(0, where.indices, packed)
    return out.reshape(batch, seq, *packed.shape[1:])


def _whole(x: Tensor) -> Unpadded:
    """Every token of every row, packed (cu_seqlens of equal steps)."""
    import torch

    batch, seq = x.shape[:2]
    cu = torch.arange(0, (batch + 1) * seq, seq, dtype=torch.int32, device=x.device)
    return Unpadded(x.reshape(batch * seq, *x.shape[2:]), cu[:0], cu, seq)


class Spans(NamedTuple):
    """Key padding whose valid tokens are one run per row (right or left padding, or
    any single span), for a kernel that takes ``seqused_q``/``seqused_k``: the
    batch flattened to (batch * seq, heads, head_size) is served where it lies,
    sequence ``i`` being the ``seqused[i]`` tokens from ``cu_seqlens[i]`` on.
    Rows with no valid key leave no sequence, as on the gather route."""

    #: (sequences + 1,) int32: each sequence's first token in the flattened batch
    #: (row * seq + the run's start), then batch * seq
    cu_seqlens_q: Tensor
    seqused_q: Tensor  # (sequences,) int32
    max_seqlen_q: int
    cu_seqlens_k: Tensor
    seqused_k: Tensor
    max_seqlen_k: int
    #: the query positions no sequence covers (the kernel leaves them unwritten):
    #: zeroed after the call; None where there is none
    padded_q: Tensor | None


def _spans(valid: Tensor, batch: int, seq_q: int, seq_kv: int, tied: bool) -> Spans | None:
    """The :class:`Spans` of ``valid`` (batch, seq_kv), or None where a row's valid
    keys are not one run. ``tied``: query i is key i (the queries' runs are the
    keys'); otherwise every query of a row with a valid key is computed."""
    import torch

    if valid.shape[1] == 0:
        return None
    # one run per row: at most one rise (a valid token after a padded one, or first)
    rises = valid[:, 0].to(torch.int64) + (valid[:, 1:] & ~valid[:, :-1]).sum(1)
    lengths = valid.sum(dim=1)
    has_keys = lengths > 0
    # one host synchronisation (on a GPU) for every size the plan needs
    most_rises, max_k, sequences, total = torch.stack(
        [rises.max(), lengths.max(), has_keys.sum(), lengths.sum()]
    ).tolist()
    if most_rises > 1:
        return None
    rows = torch.nonzero_static(has_keys, size=sequences).reshape(-1)
    used_k = lengths[rows].to(torch.int32)
    starts = valid.to(torch.uint8).argmax(dim=1)  # the first valid key (the first maximum)

    def cumulative(first: Tensor, end: int) -> Tensor:
        cu = torch.empty(first.shape[0] + 1, dtype=torch.int32, device=valid.device)
        cu[:-1] = first
        cu[-1] = end
        return cu

    cu_k = cumulative(rows * seq_kv + starts[rows], batch * seq_kv)
    if tied:
        skipped, uncovered = valid.logical_not(), batch * seq_kv - total
        cu_q, used_q, max_q = cu_k, used_k, max_k
    else:
        skipped = has_keys.logical_not()[:, None].expand(batch, seq_q)
        uncovered = (batch - sequences) * seq_q
        cu_q = cumulative(rows * seq_q, batch * seq_q)
        used_q = torch.full_like(used_k, seq_q)
        max_q = seq_q if sequences else 0
    padded_q = None
    if uncovered:
        padded_q = torch.nonzero_static(skipped.reshape(-1), size=uncovered).reshape(-1)
    return Spans(cu_q, used_q, max_q, cu_k, used_k, max_k, padded_q)


class MaskPlan(NamedTuple):
    """What the unpad route needs from one mask: its kind and its packings (or,
    for a kernel that takes ``seqused``, its spans where it has them)."""

    #: the observed kind (``valid`` dropped: the packings hold what is needed)
    seen: ObservedMask
    #: where the valid keys go (key padding only)
    keys: Packing | None
    #: where the computed queries go: ``keys`` where query i is tied to key i
    #: (self-attention, causal or with a mask that marks the padded queries),
    #: every query of a row with a valid key otherwise (key padding only)
    queries: Packing | None
    #: one run of valid tokens per row, asked for by a kernel that takes
    #: ``seqused`` (then ``keys`` and ``queries`` are None: nothing is gathered)
    spans: Spans | None = None

    @property
    def key_padding(self) -> bool:
        """The mask is key padding (the route serves it)."""
        return self.spans is not None or (self.keys is not None and self.queries is not None)


def _plan(mask: Tensor, batch: int, seq_q: int, seq_kv: int, causal: bool, spans: bool) -> MaskPlan:
    seen = observe_mask(mask, batch, seq_q, seq_kv)
    valid = seen.valid
    if seen.kind is not MaskKind.KEY_PADDING or valid is None:
        return MaskPlan(seen, None, None)
    # query i tied to key i (the padded queries dropped): self-attention whose mask
    # marks the padded queries or that is causal; otherwise every query of a row
    # that has a valid key (docs/masks.md)
    tied = seq_q == seq_kv and (causal or seen.causal or seen.marks_queries)
    if spans:
        runs = _spans(valid, batch, seq_q, seq_kv, tied)
        if runs is not None:
            return MaskPlan(seen._replace(valid=None), None, None, runs)
    keys = packing(valid)
    queries = keys if tied else packing(valid.any(dim=1, keepdim=True).expand(batch, seq_q))
    return MaskPlan(seen._replace(valid=None), keys, queries)


def _with_padded(where: Packing, positions: int) -> Packing:
    """``where`` with its padded positions (the complement of its indices) and each
    position's packed row (0 at a padded one): what :func:`pad` gathers by."""
    import torch

    if where.padded is not None and where.source is not None:
        return where
    indices = where.indices
    # its size is known: no second host synchronisation on a GPU
    source = torch.full((positions,), -1, dtype=indices.dtype, device=indices.device)
    source[indices] = torch.arange(indices.shape[0], dtype=indices.dtype, device=indices.device)
    padded = torch.nonzero_static(source < 0, size=positions - indices.shape[0]).reshape(-1)
    return where._replace(padded=padded, source=source.clamp_(min=0))


def _reused(plan: MaskPlan, batch: int, seq_q: int, seq_kv: int) -> MaskPlan:
    """A plan used a second time: its padded positions too, so that padding back
    writes zeros to those rows only (not worth it for a mask used once)."""
    keys, queries = plan.keys, plan.queries
    if keys is None or queries is None or queries.padded is not None:
        return plan
    tied = queries is keys
    keys = _with_padded(keys, batch * seq_kv)
    queries = keys if tied else _with_padded(queries, batch * seq_q)
    return plan._replace(keys=keys, queries=queries)


#: how many masks' plans are kept (one forward passes one or two: self and cross)
PLANS_KEPT = 8

_lock = threading.RLock()  # a mask's weakref callback may run while it is held
# both belong to one registry generation (attnres._memo): a registry change
# rebuilds the adapters and the plans
_VARLEN: GenerationMemo[str, Any] = GenerationMemo()
# (id(mask), batch, seq_q, seq_kv, causal call, spans asked for, inference mode)
#   -> (weakref to mask, version, plan)
_PlanKey = tuple[int, int, int, int, bool, bool, bool]
_PLANS: GenerationMemo[_PlanKey, tuple[Any, int, MaskPlan]] = GenerationMemo()


def mask_plan(
    mask: Tensor, batch: int, seq_q: int, seq_kv: int, *, causal: bool = False, spans: bool = False
) -> MaskPlan:
    """The kind and packings of ``mask`` for a call (``causal``: the call's causal
    flag, which decides the queries), computed once per mask tensor.

    ``spans``: the kernel takes ``seqused``, so a mask whose valid tokens are
    one run per row gets :attr:`MaskPlan.spans` instead of packings.

    Reused while the same tensor object comes back with the same version
    counter (torch bumps it on every in-place change, through any view) and
    the same shapes; built afresh otherwise. Not kept: inference tensors (they
    have no version counter, so an in-place change could not be seen), and
    calls being traced by torch.compile. Built in inference mode, a plan is
    kept apart from one built outside it (inference tensors cannot be saved
    for backward). Changes torch cannot see (through ``.data``, or a NumPy
    view of the storage) are not seen here either, as autograd does not see
    them.
    """
    import torch

    if mask.is_inference() or torch.compiler.is_dynamo_compiling():
        return _plan(mask, batch, seq_q, seq_kv, causal, spans)
    key = (id(mask), batch, seq_q, seq_kv, causal, spans, torch.is_inference_mode_enabled())
    version = mask._version
    with _lock:
        kept = _PLANS.get(key)
    if kept is not None and kept[0]() is mask and kept[1] == version:
        plan = kept[2]
        if plan.queries is not None and plan.queries.padded is None:
            plan = _reused(plan, batch, seq_q, seq_kv)
            with _lock:
                if _PLANS.get(key) is kept:
                    _PLANS[key] = (kept[0], version, plan)
        return plan
    plan = _plan(mask, batch, seq_q, seq_kv, causal, spans)
    ref = weakref.ref(mask, lambda gone: _forget(key, gone))
    with _lock:
        plans = _PLANS.current()
        plans.pop(key, None)
        plans[key] = (ref, version, plan)
        while len(plans) > PLANS_KEPT:
            del plans[next(iter(plans))]
    return plan


def get_varlen_kernel(spec: BackendSpec) -> VarlenKernelFn:
    """The varlen adapter ``spec.varlen_kernel`` names, built once (lazy import)."""
    path = spec.varlen_kernel
    if path is None:
        raise InvalidArgumentError(f"backend {spec.name!r} has no varlen entry point")
    with _lock:
        built = _VARLEN.get(path)
    if built is not None:
        fn: VarlenKernelFn = built
        return fn
    module, _, factory = path.partition(":")
    fn = getattr(importlib.import_module(module), factory)()
    with _lock:
        _VARLEN.setdefault(path, fn)
    return fn


def _forget(key: _PlanKey, gone: Any) -> None:
    """A kept mask was freed: drop its plan (unless its id already names another)."""
    with _lock:
        kept = _PLANS.get(key)
        if kept is not None and kept[0] is gone:
            del _PLANS[key]


def clear_varlen_cache() -> None:
    """Forget the built varlen adapters (tests that swap fake packages) and the
    kept mask plans."""
    with _lock:
        _VARLEN.clear()
        _PLANS.clear()


#: keyword features of a layer the varlen route does not take (kernels.specialized
#: passes them with the backend's options, which it does take: issue 23)
_NOT_ON_VARLEN: Final = frozenset({"softcap", "window"})


def padded_kernel(
    backend: str,
    dense: KernelFn,
    varlen: Callable[[], VarlenKernelFn],
    *,
    bottom_right: bool = False,
) -> KernelFn:
    """``dense`` for calls with no mask; unpad, ``varlen``, pad for key-padding masks.

    ``varlen`` builds the varlen kernel (on the first masked call). Any other
    mask is a :class:`MaskKindError` naming the observed kind. ``bottom_right``:
    the layer's causal mask is bottom-right aligned, so a causal call with
    unequal lengths runs through the varlen kernel (whose causal mask is).
    """
    holder: list[tuple[VarlenKernelFn, bool]] = []

    def kernel() -> tuple[VarlenKernelFn, bool]:
        """The varlen kernel, and whether it takes ``seqused`` (its adapter says)."""
        if not holder:
            built = varlen()
            holder.append((built, getattr(built, "takes_seqused", False) is True))
        return holder[0]

    def attention(
        q: Tensor,
        k: Tensor,
        v: Tensor,
        attn_mask: Tensor | None,
        causal: bool,
        scale: float | None,
        **features: Any,
    ) -> Tensor:
        batch, seq_q, heads, size = q.shape
        seq_kv = k.shape[1]
        if seq_kv == 0:  # issue 30: no keys, as torch SDPA answers them (not unpadded)
            return no_keys_output(q, k, v)
        # issue 23: the backend's options (the features) reach the varlen entry point
        # too; softcap and windows it is not given
        refused = bool(features) and not _NOT_ON_VARLEN.isdisjoint(features)
        if attn_mask is None:
            if causal and bottom_right and seq_q != seq_kv and not refused:
                qs, ks, vs = _whole(q), _whole(k), _whole(v)
                out = kernel()[0](
                    qs.packed, ks.packed, vs.packed, qs.cu_seqlens, ks.cu_seqlens,
                    seq_q, seq_kv, True, scale, **features,
                )  # fmt: skip
                return out.reshape(batch, seq_q, heads, size)
            return dense(q, k, v, None, causal, scale, **features)
        try:
            run, seqused = kernel()
        except KernelUnavailableError:
            # a mask of another kind is the error to report, whatever the install
            _check_key_padding(backend, mask_plan(attn_mask, batch, seq_q, seq_kv, causal=causal))
            raise
        # the span route leaves the padded rows of dq/dk/dv unwritten by the kernel
        # (torch::empty in FA3's backward, torch.empty in FA4's): gathered, they get zeros
        seqused = seqused and not (
            (q.requires_grad or k.requires_grad or v.requires_grad) and _grad_enabled()
        )
        plan = mask_plan(attn_mask, batch, seq_q, seq_kv, causal=causal, spans=seqused)
        seen, keys, queries, spans = plan
        _check_key_padding(backend, plan)
        if refused:
            raise MaskKindError(
                f"attention backend {backend!r}: softcap and sliding windows are not taken "
                f"together with a key-padding mask on the varlen route",
                seen.words,
            )
        causal = causal or seen.causal
        if causal and seq_q != seq_kv:
            raise MaskKindError(
                f"attention backend {backend!r}: causal attention with key padding needs equal "
                f"query and key lengths on the varlen route (here {seq_q} != {seq_kv})",
                seen.words,
            )
        if spans is not None:  # one run per row: the kernel reads the padded layout
            if spans.max_seqlen_k == 0:  # every row fully padded
                return q.new_zeros(q.shape)
            out = run(
                _flat(q), _flat(k), _flat(v), spans.cu_seqlens_q, spans.cu_seqlens_k,
                spans.max_seqlen_q, spans.max_seqlen_k, causal, scale,
                seqused_q=spans.seqused_q, seqused_k=spans.seqused_k, **features,
            )  # fmt: skip
            if spans.padded_q is not None:  # rows no sequence covers: unwritten
                out.index_fill_(0, spans.padded_q, 0)
            return out.reshape(batch, seq_q, *out.shape[1:])
        assert keys is not None and queries is not None  # plan.key_padding
        if keys.max_seqlen == 0:  # every row fully padded
            return q.new_zeros(q.shape)
        # self-attention whose mask (or causal flag) ties query i to key i: the
        # queries are padded like the keys; otherwise (a mask every query shares,
        # which cross-attention of equal lengths passes too) every query of a row
        # that has a valid key, as SDPA computes it (the plan holds the one this
        # call needs: mask_plan's causal argument)
        out = run(
            pack(q, queries), pack(k, keys), pack(v, keys), queries.cu_seqlens,
            keys.cu_seqlens, queries.max_seqlen, keys.max_seqlen, causal, scale, **features,
        )  # fmt: skip
        return pad(out, queries, batch, seq_q)

    return attention


def _check_key_padding(backend: str, plan: MaskPlan) -> None:
    """A :class:`MaskKindError` naming the observed kind, unless ``plan``'s mask is key padding."""
    if plan.key_padding:
        return
    seen = plan.seen
    why = f" ({seen.detail})" if seen.detail else ""
    raise MaskKindError(
        f"attention backend {backend!r} takes key-padding masks only (by unpadding "
        f"for its varlen kernel); this call's mask is {seen.words}{why}. Resolve the "
        f"layer with the mask kind it passes so that a backend that takes it is chosen",
        seen.words,
    )


def _flat(x: Tensor) -> Tensor:
    """(batch, seq, heads, head_size) as (batch * seq, heads, head_size): a view
    where the layout allows (a copy otherwise, as packing would make)."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _grad_enabled() -> bool:
    import torch

    return torch.is_grad_enabled()


def route_kernel(
    spec: BackendSpec,
    dense: KernelFn,
    mask: MaskKind,
    alignment: CausalAlignment = CausalAlignment.TOP_LEFT,
) -> KernelFn:
    """The kernel a layer of this mask kind runs on ``spec``'s backend.

    ``dense`` itself where the kernel takes the kind natively (or no mask is
    passed); the unpad route (:func:`padded_kernel`) where the spec takes key
    padding by unpadding, or the layer's causal mask is bottom-right and the
    spec has a varlen entry point.
    """
    bottom_right = _bottom_right(spec, alignment)
    if not (_unpads(spec, mask) or bottom_right):
        return dense
    return padded_kernel(
        spec.name, dense, lambda: get_varlen_kernel(spec), bottom_right=bottom_right
    )


def _bottom_right(spec: BackendSpec, alignment: CausalAlignment) -> bool:
    return (
        alignment is CausalAlignment.BOTTOM_RIGHT
        and spec.varlen_kernel is not None
        and spec.varlen_causal_unequal
    )


def _unpads(spec: BackendSpec, mask: MaskKind) -> bool:
    if mask is not MaskKind.KEY_PADDING:
        return False
    support = spec.mask_support(mask)
    return support is not None and support.route is MaskRoute.UNPAD


def check_layer_options(
    spec: BackendSpec | None, layer: LayerSpec, platform: Platform | None, where: str = ""
) -> None:
    """:func:`check_route_options` for ``layer`` served by ``spec``'s backend on
    ``platform`` (its CUDA capability; ``None`` or another kind: not known, the
    kernel adapter checks on the tensors' device). Free when the layer has no
    options for that backend."""
    if spec is None or not layer.backend_options:
        return
    options = dict(layer.backend_options).get(spec.name)
    if not options:
        return
    capability = None if platform is None or platform.kind != "cuda" else platform.capability
    if platform is not None:
        _check_installed_options(platform.installed(spec), options, layer, capability, where)
        spec = platform.installed(spec)[0]
    if spec.entry_points:
        req = layer.requirements
        check_route_options(spec, options, capability, req.mask, req.causal_alignment, where)


def _check_installed_options(
    installed: tuple[BackendSpec, tuple[KernelFacts, ...]],
    options: tuple[tuple[str, OptionValue], ...],
    layer: LayerSpec,
    capability: tuple[int, int] | None,
    where: str,
) -> None:
    """Issue 31: the layer's options against the kernel installed here -- an
    option its version does not take (SageAttention 1 has no ``qk_quant_gran``),
    or a value it refuses for this layer on this GPU (``OptionLimit``: FA4's
    ``deterministic=True`` in the backward pass on sm120) -- as a
    :class:`~attnres.errors.BackendOptionError` when the layer is built, not in
    its first call. A limit bound to GPUs applies only on a known capability."""
    spec, applied = installed
    kernel = f" ({applied[-1].kernel}, {applied[-1].describe()})" if applied else ""
    declared = {o.name: o for o in spec.options}
    given = dict(options)
    for name, value in options:
        option = declared.get(name)
        if option is None:
            takes = ", ".join(sorted(declared)) or "none"
            raise BackendOptionError(
                f"backend_options{where}: {spec.name}.{name} is not taken by the {spec.name} "
                f"kernel installed here{kernel}; it takes: {takes}. Drop {name} for this "
                f"platform, or install the kernel version that takes it (docs/backends.md)",
                spec.name,
                name,
            )
        option.check(spec.name, value)
    needed = layer.requirements.needed()
    for limit in spec.option_limits:
        if limit.capabilities is not None and capability is None:
            continue
        if limit.applies(given, needed, capability, layer.head_size):
            raise BackendOptionError(
                f"backend_options{where}: {spec.name} refuses {limit.describe()} "
                f"({limit.because}). Drop {limit.option}={limit.value!r} for this layer, or "
                f"run it on another backend (docs/backends.md#per-backend-options)",
                spec.name,
                limit.option,
            )


def check_route_options(
    spec: BackendSpec,
    options: tuple[tuple[str, OptionValue], ...],
    capability: tuple[int, int] | None,
    mask: MaskKind,
    alignment: CausalAlignment,
    where: str = "",
) -> None:
    """Issue 23: the options a layer of this mask kind gives ``spec``'s kernel are
    taken by the function that runs them on a device of ``capability`` -- the
    dense one, and the varlen one too where :func:`route_kernel` unpads (a call
    with no mask still runs the dense one). A
    :class:`~attnres.errors.BackendOptionError` otherwise; nothing to check for
    a kernel that takes its options itself (no ``BackendSpec.entry_points``)."""
    if not options or not spec.entry_points:
        return
    entry_point_options(spec.name, options, capability, where=where)
    if _unpads(spec, mask) or _bottom_right(spec, alignment):
        entry_point_options(
            spec.name, options, capability, varlen=True, where=where + " (the unpad route)"
        )
