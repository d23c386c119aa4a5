"""Issue 19: softmax attention computed by hand, run by any kernel.

A transformers module that computes its attention by hand (a product of the
query and the keys, a softmax, a product with the values; Bloom, BLIP,
GPT-Neo, XLNet and about seventy more model types) calls no attention entry
point a route could take. Its *deferred-scores route* takes the computation
itself, observed as it runs, never read from a class name:

- while the site's forward runs, a ``TorchFunctionMode`` defers every product
  of two batched tensors shaped like attention scores (query ``(..., seq_q,
  size)`` times keys ``(..., size, seq_kv)``, one to three leading
  dimensions: ``matmul``, ``bmm``, ``@``, ``baddbmm``, a two-operand
  ``einsum``, an ellipsis in it included): the result is a :class:`Deferred`
  tensor that holds how to compute it, and no storage;
- what the code does to the deferred scores is recorded (each operation, its
  arguments), and its shape is inferred on the ``meta`` device;
- when the deferred probabilities meet the values in a product, the recorded
  operations are read as one attention (:func:`read_attention`): a softmax over
  the keys of the scores scaled by numbers or by a positive factor per query
  row (folded into the query), plus additive masks, masked fills and
  ``where`` with a very negative value, dtype casts, views (the softmax must
  meet the scores shaped as the product made them), attention dropout. What
  it reads is one call of the route's kernel (q, k, v, the mask, the scale),
  checked against the plan before it runs
  (:meth:`._route.GenericRoute.kernel_for`), as every route's call is;
- anything else done to deferred scores (a position bias computed from them,
  a head mask, a ``pow``) computes them as the code would, in the code's own
  order (bit-identical), and the product is the site's own math: a fact the
  call brings (``own math``), which re-resolves the site to its own code
  (``eager``) or, in a strict component, raises a typed error naming it.

Deferred tensors that leave the forward stay deferred: transformers' attention
modules return their weights on every call, and a caller that drops them
(every caller, unless ``output_attentions``) never pays for them; one that
uses them gets them computed at that use, as the code would have computed
them (from the query and keys of that call).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from attnres.errors import ArgumentTypeError, DeferredScoresError

__all__ = [
    "MATMULS",
    "SOFTMAXES",
    "Attention",
    "DeferScores",
    "Deferred",
    "deferred_operands",
    "read_attention",
]

_T = torch.Tensor
_F = torch.nn.functional

#: products whose result may be attention scores (or, with deferred scores as
#: their first operand, an attention's output)
MATMULS = frozenset({torch.matmul, torch.bmm, _T.matmul, _T.bmm, _T.__matmul__})
_BADDBMM = frozenset({torch.baddbmm, _T.baddbmm})
_EINSUM = torch.functional.einsum
#: the softmaxes that normalise scores
SOFTMAXES = frozenset({torch.softmax, _F.softmax, _T.softmax, torch.special.softmax})
#: what leaves the values as they are (for attention): dtype casts, copies
_KEEP = frozenset(
    {
        _T.to,
        _T.float,
        _T.half,
        _T.bfloat16,
        _T.double,
        _T.type,
        _T.type_as,
        _T.contiguous,
        _T.clone,
        torch.clone,
    }
)
#: of those, the ones whose result may be their input itself (an alias): the
#: code changing it in place changes what it came from
_ALIASES = frozenset(
    {_T.to, _T.float, _T.half, _T.bfloat16, _T.double, _T.type, _T.type_as, _T.contiguous}
)
_VIEWS = frozenset({_T.view, _T.reshape, torch.reshape, _T.view_as, _T.reshape_as})
#: what may swap the last two dimensions: probabilities transposed into the
#: second operand of the values' product (``bmm(v, p.permute(0, 2, 1))``: Janus's VQ)
_SWAPS = frozenset({torch.transpose, _T.transpose, _T.permute, torch.permute})
_MULS = frozenset({torch.mul, _T.mul, _T.__mul__, _T.__rmul__, _T.mul_, _T.__imul__})
_DIVS = frozenset(
    {torch.div, _T.div, _T.__truediv__, torch.true_divide, _T.true_divide, _T.div_}
    | {_T.__itruediv__}
)
_ADDS = frozenset({torch.add, _T.add, _T.__add__, _T.__radd__, _T.add_, _T.__iadd__})
_SUBS = frozenset({torch.sub, _T.sub, _T.__sub__, _T.sub_, _T.__isub__})
_FILLS = frozenset({torch.masked_fill, _T.masked_fill, _T.masked_fill_})
_WHERE = frozenset({torch.where, _T.where})
_DROPOUT = frozenset({_F.dropout, torch.dropout})
#: a floor at a masked value (``torch.max(scores, finfo.min)``): nothing for the softmax
_FLOORS = frozenset(
    {torch.max, _T.max, torch.maximum, _T.maximum, torch.clamp, _T.clamp, torch.clamp_min}
    | {_T.clamp_min}
)
_IN_PLACE = frozenset(
    {_T.mul_, _T.__imul__, _T.div_, _T.__itruediv__, _T.add_, _T.__iadd__, _T.sub_}
    | {_T.__isub__, _T.masked_fill_}
)
#: what reads a tensor's metadata only (answered by the deferred tensor itself)
_METADATA = frozenset(
    {
        _T.size,
        _T.dim,
        _T.numel,
        _T.stride,
        _T.is_floating_point,
        _T.is_contiguous,
        _T.element_size,
        _T.get_device,
        _T.__len__,
        _T.shape.__get__,  # type: ignore[attr-defined]
        _T.dtype.__get__,  # type: ignore[attr-defined]
        _T.device.__get__,
        _T.ndim.__get__,  # type: ignore[attr-defined]
        _T.is_cuda.__get__,  # type: ignore[attr-defined]
        _T.layout.__get__,  # type: ignore[attr-defined]
    }
)
#: what reads only the shape of its second operand: a mask expanded as the
#: scores (XLM's ``mask.view(...).expand_as(scores)``) reads nothing else of them
_SHAPED: dict[Any, Callable[[Any, Any], Any]] = {
    _T.expand_as: lambda t, like: t.expand(like.shape),
    _T.view_as: lambda t, like: t.view(like.shape),
    _T.reshape_as: lambda t, like: t.reshape(like.shape),
}
#: a masked score at most this: the position takes no part in the softmax
_MASKED = -1e4
#: the in-place operators (torch's other in-place operations end in ``_``)
_OPERATORS = ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or")
_IN_PLACE_DUNDERS = frozenset(f"__i{op}__" for op in (*_OPERATORS, "xor", "lshift", "rshift")) | {
    "__setitem__"
}
#: func -> whether it changes its first argument in place (memoised)
_MUTATES: dict[Any, bool] = {}


def _mutates(func: Any, kwargs: dict[str, Any]) -> bool:
    """Whether ``func`` may change a tensor in place: its name says so (torch's
    convention: ``tril_``, ``__setitem__``, ``__iadd__``), or it writes to ``out``
    or takes ``inplace=True``."""
    found = _MUTATES.get(func)
    if found is None:
        name = getattr(func, "__name__", "")
        found = (name.endswith("_") and not name.endswith("__")) or name in _IN_PLACE_DUNDERS
        if len(_MUTATES) < _INFERRED_MAX:
            _MUTATES[func] = found
    return found or (bool(kwargs) and ("out" in kwargs or kwargs.get("inplace") is True))


def _version(t: Any) -> int | None:
    """``t``'s version counter (``None``: an inference tensor, which has none)."""
    try:
        return int(t._version)
    except RuntimeError:
        return None


def _tensors(obj: Any, out: list[Any]) -> list[Any]:
    """The real tensors in ``obj`` (a tensor, or a list, tuple or dict of them)."""
    if isinstance(obj, torch.Tensor):
        if not isinstance(obj, Deferred):
            out.append(obj)
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            _tensors(o, out)
    elif isinstance(obj, dict):
        for o in obj.values():
            _tensors(o, out)
    return out


def _grad_state() -> tuple[bool, bool]:
    return torch.is_grad_enabled(), torch.is_inference_mode_enabled()


class _Node:
    """One recorded operation on deferred scores (or the product that made them)."""

    __slots__ = (
        "alias",
        "alpha",
        "args",
        "bias",
        "done",
        "func",
        "key",
        "kwargs",
        "product",
        "query",
        "read",
        "seen",
        "shape",
        "state",
        "uses",
        "value",
    )

    def __init__(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], shape: tuple[int, ...]
    ) -> None:
        self.func = func
        self.args = args
        self.kwargs = kwargs
        #: the result's shape (inferred on the meta device)
        self.shape = shape
        self.value: Any = None
        #: a product that made scores: the query and keys (..., seq, size), the
        #: additive bias and the factor it carried (``baddbmm``)
        self.product = False
        self.query: Any = None
        self.key: Any = None
        self.bias: Any = None
        self.alpha = 1.0
        #: the real tensors it read and their versions then (operands are read at
        #: the moment the code used them: one changed in place since is not this)
        self.read: list[tuple[Any, int | None]] = []
        #: grad mode and inference mode when the code ran it (it runs in them)
        self.state = _grad_state()
        #: recorded operations that take it as an operand
        self.uses = 0
        #: its result may be its operand itself (a view, a cast to the same dtype)
        self.alias = False
        #: what the code did with its value that the route does not model (it saw
        #: the real tensor: an in-place write, its autograd state, a hook ...)
        self.seen: str | None = None
        #: its value's version when computed (changed since: written in place)
        self.done: int | None = None

    def note_read(self) -> None:
        for t in _tensors((self.args, self.kwargs, self.query, self.key, self.bias), []):
            self.read.append((t, _version(t)))

    def changed(self) -> str | None:
        """Which tensor it read was changed in place since (in words), if one was."""
        for t, version in self.read:
            if version is not None and _version(t) != version:
                return f"a tensor of shape {list(t.shape)} it read changed in place after its use"
        return None

    def compute(self) -> Any:
        """What the code would have computed here (memoised): its operations in its order."""
        if self.value is None:
            changed = self.changed()
            if changed is not None:
                name = getattr(self.func, "__name__", str(self.func))
                raise DeferredScoresError(
                    f"deferred attention scores ({name}) are used after {changed}: "
                    f"computed now they would differ from what the site's code computed. "
                    f"Use the attention weights before changing their inputs in place, or "
                    f"run the site without a flag (its own code, untouched)"
                )
            args = tuple(_real(a) for a in self.args)
            kwargs = {k: _real(v) for k, v in self.kwargs.items()}
            if self.state == _grad_state():
                self.value = self.func(*args, **kwargs)
            else:  # the grad mode the code ran it in
                with torch.inference_mode(self.state[1]), torch.set_grad_enabled(self.state[0]):
                    self.value = self.func(*args, **kwargs)
            if isinstance(self.value, torch.Tensor):
                self.done = _version(self.value)
                if self.func in _IN_PLACE and isinstance(self.args[0], Deferred):
                    # followed in place (nothing else read its operand): its operand's
                    # change is this one
                    self.args[0].node.done = self.done
        return self.value

    def sound(self) -> str | None:
        """Why reading it as part of one attention now would not be what the code
        computes (in words), or ``None``."""
        if self.seen is not None:
            return self.seen
        changed = self.changed()
        if changed is not None:
            return changed
        if isinstance(self.value, torch.Tensor) and _version(self.value) != self.done:
            return "the scores changed in place"
        if self.state != _grad_state():
            return "the scores computed under another grad mode"
        return None


class Deferred(torch.Tensor):
    """Attention scores not computed: the recorded operations that make them.

    It answers what its shape, dtype and device are; anything else done to it
    outside a :class:`DeferScores` computes it first (as the code would)."""

    node: _Node
    like_dtype: torch.dtype

    @staticmethod
    def __new__(cls, node: _Node, like: Any) -> Deferred:
        out = torch.Tensor._make_wrapper_subclass(
            cls, like.shape, dtype=like.dtype, device=like.device_, requires_grad=False
        )
        out.node = node
        out.like_dtype = like.dtype
        return out

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        return func(*_real(tuple(args)), **_real(dict(kwargs)))

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None
    ) -> Any:
        # below torch functions (an operator no torch function names): computed
        return func(*_real(tuple(args)), **_real(dict(kwargs or {})))

    def __repr__(self) -> str:  # type: ignore[override]
        return repr(self.node.compute())


class _Like:
    __slots__ = ("device_", "dtype", "shape")

    def __init__(self, shape: Any, dtype: Any, device: Any) -> None:
        self.shape, self.dtype, self.device_ = shape, dtype, device


def _real(obj: Any) -> Any:
    """``obj`` with every deferred tensor in it computed."""
    if isinstance(obj, Deferred):
        return obj.node.compute()
    if isinstance(obj, (tuple, list)):
        return type(obj)(_real(o) for o in obj)
    if isinstance(obj, dict):
        return {k: _real(v) for k, v in obj.items()}
    return obj


def _swap_of(func: Any, args: Sequence[Any], kwargs: Any) -> Deferred | None:
    """The deferred tensor ``func(*args)`` swaps the last two dimensions of (and
    nothing else), if it does."""
    if func not in _SWAPS or kwargs or not args or type(args[0]) is not Deferred:
        return None
    n = len(args[0].node.shape)
    dims = args[1:]
    if (
        func in (_T.permute, torch.permute)
        and len(dims) == 1
        and isinstance(dims[0], (list, tuple))
    ):
        dims = tuple(dims[0])
    if func in (_T.permute, torch.permute):
        order = [d % n for d in dims] if all(isinstance(d, int) for d in dims) else []
        want = [*range(n - 2), n - 1, n - 2]
        return args[0] if order == want else None
    if len(dims) == 2 and all(isinstance(d, int) for d in dims):
        return args[0] if {d % n for d in dims} == {n - 2, n - 1} else None
    return None


def _storage(t: Any) -> int:
    try:
        return int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError, TypeError):
        return -1  # no storage of its own: any change in place is a change of it


def _deferred_in(obj: Any, out: list[Deferred]) -> list[Deferred]:
    if isinstance(obj, Deferred):
        out.append(obj)
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            _deferred_in(o, out)
    elif isinstance(obj, dict):
        for o in obj.values():
            _deferred_in(o, out)
    return out


def _has_deferred(args: Sequence[Any]) -> bool:
    """Whether a deferred tensor is among ``args`` (or in a list or tuple there:
    ``einsum``'s operands, ``cat``'s tensors). Runs on every torch call the
    site's forward makes: plain loops, no recursion."""
    for a in args:
        kind = type(a)
        if kind is Deferred:
            return True
        if kind is list or kind is tuple:
            for b in a:
                if type(b) is Deferred:
                    return True
    return False


def _meta(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return torch.empty(obj.shape, dtype=obj.dtype, device="meta")
    if isinstance(obj, (tuple, list)):
        return type(obj)(_meta(o) for o in obj)
    return obj


#: (operation, what its arguments are) -> its result's (shape, dtype): a site's
#: forward makes the same operations on every call of one signature, and the
#: meta device is slow next to a dictionary
_INFERRED: dict[tuple[Any, ...], tuple[tuple[int, ...], Any]] = {}
_INFERRED_MAX = 4096


class _Uncached(Exception):
    pass


def _key(obj: Any) -> Any:
    kind = type(obj)
    if kind is Deferred:
        return (obj.node.shape, obj.like_dtype)
    if isinstance(obj, torch.Tensor):
        return (tuple(obj.shape), obj.dtype)
    if kind is list or kind is tuple:
        return (kind, tuple(_key(o) for o in obj))
    if kind in (int, float, bool, str, torch.dtype, type(None)):
        return (kind, obj)
    raise _Uncached


def _infer(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """The shape and dtype ``func(*args, **kwargs)`` has (run on the meta device
    once per signature)."""
    try:
        key: Any = (func, _key(args), _key(tuple(kwargs.items())) if kwargs else None)
    except _Uncached:
        key = None
    if key is not None:
        found = _INFERRED.get(key)
        if found is not None:
            return found
    out = func(*_meta(args), **_meta(kwargs))
    if not isinstance(out, torch.Tensor):
        raise ArgumentTypeError("not a tensor")
    found = (tuple(out.shape), out.dtype)
    if key is not None:
        if len(_INFERRED) >= _INFERRED_MAX:
            _INFERRED.clear()
        _INFERRED[key] = found
    return found


def _is_scores_product(a: Any, b: Any) -> bool:
    return (
        type(a) is torch.Tensor
        and type(b) is torch.Tensor
        and a.dim() in (3, 4, 5)
        and b.dim() == a.dim()
        and a.shape[-1] == b.shape[-2]
        and a.shape[-1] != 1
    )


# =============================================================================
# einsum: which operand is the query, which the keys
# =============================================================================


class _Einsum:
    """A two-operand einsum read as a batched product: the letters of the batch
    (in the output's order), the rows of the first operand, the columns of the
    second, the contracted one. An ellipsis standing for as many dimensions in
    both operands and the output (LongT5's local attention, ``...qhd,...khd->
    ...hqk``) is read as that many letters of the batch."""

    __slots__ = ("batch", "col", "contracted", "lhs", "out", "rhs", "row")

    def __init__(self, equation: str, a_dim: int, b_dim: int) -> None:
        eq = equation.replace(" ", "")
        inputs, _, out = eq.partition("->")
        lhs, _, rhs = inputs.partition(",")
        if "..." in eq:
            lhs, rhs, out = _ellipsis(lhs, rhs, out, a_dim, b_dim)
        self.lhs, self.rhs, self.out = lhs, rhs, out
        self.row = [c for c in lhs if c in out and c not in rhs]
        self.col = [c for c in rhs if c in out and c not in lhs]
        self.contracted = [c for c in lhs if c in rhs and c not in out]
        self.batch = [c for c in out if c in lhs and c in rhs]

    def valid(self, a: Any, b: Any) -> bool:
        letters = self.lhs + self.rhs + self.out
        return (
            "." not in letters
            and len(self.row) == 1
            and len(self.col) == 1
            and len(self.contracted) == 1
            and len(self.lhs) == len(set(self.lhs)) == a.dim()
            and len(self.rhs) == len(set(self.rhs)) == b.dim()
            and len(self.out) == len(set(self.out))
            and len(self.lhs) == len(self.batch) + 2
            and len(self.rhs) == len(self.batch) + 2
            and len(self.out) == len(self.batch) + 2
            and 1 <= len(self.batch) <= 3
        )

    def arrange(self, t: Any, letters: str, last: str) -> Any:
        """``t`` (its dimensions ``letters``) as (batch..., the other letter, ``last``)."""
        other = next(c for c in letters if c not in self.batch and c != last)
        order = [letters.index(c) for c in (*self.batch, other, last)]
        return t.permute(*order)

    def output(self, t: Any) -> Any:
        """``t`` in (batch..., row, col) as the equation's output."""
        have = [*self.batch, self.row[0], self.col[0]]
        return t.permute(*[have.index(c) for c in self.out])


def _ellipsis(lhs: str, rhs: str, out: str, a_dim: int, b_dim: int) -> tuple[str, str, str]:
    """The three subscripts with an ellipsis spelled as letters none of them uses,
    where it stands for as many dimensions in both operands (else unchanged: the
    ``.`` left in them makes :meth:`_Einsum.valid` false)."""
    n = a_dim - len(lhs.replace("...", ""))
    if (
        n < 0
        or b_dim - len(rhs.replace("...", "")) != n
        or any(part.count("...") != 1 for part in (lhs, rhs, out))
    ):
        return lhs, rhs, out
    free = [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in lhs + rhs + out][:n]
    fill = "".join(free)
    return lhs.replace("...", fill), rhs.replace("...", fill), out.replace("...", fill)


def _einsum_operands(args: tuple[Any, ...]) -> tuple[str, Any, Any] | None:
    if not args or not isinstance(args[0], str):
        return None
    rest = args[1:]
    if len(rest) == 1 and isinstance(rest[0], (list, tuple)):
        rest = tuple(rest[0])
    if len(rest) != 2:
        return None
    return args[0], rest[0], rest[1]


# =============================================================================
# Reading the recorded operations as one attention
# =============================================================================


class Attention:
    """One attention read from deferred probabilities and the values they meet:
    q, k, v as (batch, heads, seq, size), the mask (SDPA semantics, broadcastable
    to (batch, heads, seq_q, seq_kv)), the softmax scale, the dropout, and how to
    give the kernel's output the shape the code's product has."""

    __slots__ = ("dropout", "finish", "k", "mask", "q", "scale", "v")

    def __init__(
        self,
        q: Any,
        k: Any,
        v: Any,
        mask: Any,
        scale: float,
        dropout: float,
        finish: Callable[[Any], Any],
    ) -> None:
        self.q, self.k, self.v, self.mask = q, k, v, mask
        self.scale, self.dropout, self.finish = scale, dropout, finish


def _number(obj: Any) -> float | None:
    if isinstance(obj, bool):
        return None
    if isinstance(obj, (int, float)):
        return float(obj)
    if isinstance(obj, torch.Tensor) and not isinstance(obj, Deferred) and obj.numel() == 1:
        return float(obj.item())
    return None


def _fill(obj: Any) -> float | None:
    value = _number(obj)
    return value if value is not None and value <= _MASKED else None


class _Reading:
    """The state of :func:`read_attention` along the recorded operations."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        #: the product's shape: (lead..., seq_q, seq_kv)
        self.product = shape
        self.shape = shape
        self.scale = 1.0
        #: a positive factor per query row (shape (..., 1) against ``shape``: a
        #: per-head logit scale, Swin V2's), folded into the query; None: none
        self.factor: Any = None
        self.masks: list[Any] = []  # additive (float) or keep (bool), against ``shape``
        self.softmax = False
        self.dropout = 0.0
        #: positions a product with a 0/1 tensor set to zero: read as masked only
        #: where the masks read mask them too (GPT's ``w * b + -1e4 * (1 - b)``)
        self.zeroed: list[Any] = []

    def rescale(self, factor: float) -> None:
        self.scale *= factor
        self.masks = [m * factor if m.dtype != torch.bool else m for m in self.masks]

    def rescale_rows(self, factor: Any) -> None:
        """Scores times a positive tensor constant along the keys (``factor``:
        shape (..., 1), broadcast to the scores): the query rows scaled."""
        self.masks = [m * factor if m.dtype != torch.bool else m for m in self.masks]
        self.factor = factor if self.factor is None else self.factor * factor

    def attention_shaped(self) -> bool:
        """Whether the scores are now shaped as the product made them: (lead...,
        seq_q, seq_kv), the same elements in the same order."""
        return tuple(self.shape[-2:]) == tuple(self.product[-2:])

    def reshape(self, shape: tuple[int, ...]) -> bool:
        """A view of the scores: any view of the same elements in the same order
        (SegGPT splits the positions into rows and columns to add a decomposed
        position bias, then views them back); the masks, zeroed positions and
        factor read so far are viewed with them. A softmax reads the scores only
        where they are shaped as the product made them (:meth:`attention_shaped`)."""
        if math.prod(shape) != math.prod(self.shape):
            return False
        if self.factor is not None and tuple(shape[-2:]) != tuple(self.shape[-2:]):
            return False  # a factor per query row, its rows viewed apart
        self.masks = [m.expand(self.shape).reshape(shape) for m in self.masks]
        self.zeroed = [z.expand(self.shape).reshape(shape) for z in self.zeroed]
        if self.factor is not None:
            rows = (*self.shape[:-1], 1)
            self.factor = self.factor.expand(rows).reshape(*shape[:-1], 1)
        self.shape = tuple(shape)
        return True


def _step(reading: _Reading, node: _Node, at: int) -> str | None:
    """Read one operation on the scores (their operand at ``at``); ``None``: read,
    else what it does, in words (the scores are then the site's own math)."""
    func, args, kwargs = node.func, node.args, node.kwargs
    others = [a for i, a in enumerate(args) if i != at]
    name = getattr(func, "__name__", str(func))
    if func in _KEEP:
        return None
    if func in _VIEWS:
        out = node.shape
        return None if reading.reshape(tuple(out)) else f"{name} to {list(out)}"
    if func in _DROPOUT:
        p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
        training = args[2] if len(args) > 2 else kwargs.get("training", True)
        if not reading.softmax:
            return "dropout before the softmax"
        reading.dropout = float(p) if training else 0.0
        return None
    if reading.softmax and func in _FILLS and _number(_fill_value(args, kwargs)) == 0.0:
        # probabilities of masked positions set to zero: what the masks read did
        cond = _real(args[1] if len(args) > 1 else kwargs.get("mask"))
        if (
            not isinstance(cond, torch.Tensor)
            or cond.dtype != torch.bool
            or not _fits(reading, cond)
        ):
            return f"{name} of the attention probabilities"
        reading.zeroed.append(cond)
        return None
    if reading.softmax:
        return f"{name} of the attention probabilities"
    if func in SOFTMAXES:
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        if dim is None or dim not in (-1, len(reading.shape) - 1):
            return f"softmax over dimension {dim}"
        if not reading.attention_shaped():
            return f"softmax of the scores viewed as {list(reading.shape)}"
        reading.softmax = True
        return None
    if func in _FLOORS:
        floor = others[0] if len(others) == 1 and not kwargs else kwargs.get("min")
        if func in (torch.clamp, _T.clamp) and (len(others) > 1 or "max" in kwargs):
            floor = None
        return None if _fill(floor) is not None else f"{name} of the scores"
    if func in _MULS and len(others) == 1 and not kwargs and _zero_one(others[0], reading):
        reading.zeroed.append(_real(others[0]) == 0)
        return None
    if func in _MULS or func in _DIVS:
        factor = _number(others[0]) if len(others) == 1 and not kwargs else None
        if factor is None and len(others) == 1 and not kwargs and (func in _MULS or at == 0):
            rows = _row_factor(others[0], reading)
            if rows is not None:
                reading.rescale_rows(rows if func in _MULS else 1.0 / rows)
                return None
        if factor is None or (func in _DIVS and at != 0):
            return f"{name} by a tensor"
        if not factor > 0 or not math.isfinite(factor):
            # a zero, negative or infinite scale turns a masked score (-inf, a
            # masked fill) into another (the softmax's own math keeps it exact)
            return f"{name} by {factor}"
        reading.rescale(factor if func in _MULS else 1.0 / factor)
        return None
    if func in _ADDS or func in _SUBS:
        other = others[0] if len(others) == 1 else None
        alpha = _number(kwargs.get("alpha", 1.0))
        if other is None or alpha is None or (func in _SUBS and at != 0):
            return f"{name} of the scores"
        sign = -alpha if func in _SUBS else alpha
        return _add(reading, _real(other), sign, name)
    if func in _FILLS:
        cond = args[1] if len(args) > 1 else kwargs.get("mask")
        value = _fill(_fill_value(args, kwargs))
        if value is None or not isinstance(cond, torch.Tensor):
            return "masked_fill with a value that is not a mask's"
        return _keep(reading, ~_real(cond), name)
    if func in _WHERE and len(args) == 3:
        cond = _real(args[0])
        if at == 1 and _fill(args[2]) is not None:
            return _keep(reading, cond, name)
        if at == 2 and _fill(args[1]) is not None:
            return _keep(reading, ~cond, name)
        return "where with a value that is not a mask's"
    return f"{name} of the scores"


def _row_factor(obj: Any, reading: _Reading) -> Any:
    """``obj`` as a factor of the scores that scales whole query rows: a floating
    tensor, positive and finite, constant along the keys (last dimension 1: a
    logit scale per head, Swin V2's), broadcast to the scores; else None. The
    scores times it are the query times it times the keys: one attention."""
    obj = _real(obj)
    if not isinstance(obj, torch.Tensor) or not obj.is_floating_point() or obj.dim() == 0:
        return None
    if obj.shape[-1] != 1 or not _fits(reading, obj):
        return None
    if not bool(((obj > 0) & torch.isfinite(obj)).all()):
        return None
    return obj.reshape((1,) * (len(reading.shape) - obj.dim()) + tuple(obj.shape))


def _fill_value(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return args[2] if len(args) > 2 else kwargs.get("value")


def _zero_one(obj: Any, reading: _Reading) -> bool:
    obj = _real(obj)
    return (
        isinstance(obj, torch.Tensor)
        and obj.numel() > 1
        and _fits(reading, obj)
        and bool(((obj == 0) | (obj == 1)).all())
    )


def _fits(reading: _Reading, mask: Any) -> bool:
    try:
        return tuple(torch.broadcast_shapes(mask.shape, reading.shape)) == reading.shape  # type: ignore[no-untyped-call]
    except RuntimeError:
        return False


def _add(reading: _Reading, other: Any, sign: float, name: str) -> str | None:
    if not isinstance(other, torch.Tensor):
        number = _number(other)
        return None if number is not None else f"{name} of {type(other).__name__}"
    if not _fits(reading, other) or other.is_complex():
        return f"{name} of a tensor of shape {list(other.shape)}"
    if not other.is_floating_point():
        # a boolean or integer tensor added to floating scores adds its values
        # (type promotion): an additive mask of those values, never a keep mask
        other = other.to(torch.float32)
    reading.masks.append(other * sign if sign != 1.0 else other)
    return None


def _keep(reading: _Reading, keep: Any, name: str) -> str | None:
    if keep.dtype != torch.bool or not _fits(reading, keep):
        return f"{name} with a condition of shape {list(keep.shape)}"
    reading.masks.append(keep)
    return None


def _mask(masks: list[Any], dtype: Any) -> Any:
    """The masks read, as one additive mask in the query's dtype: a masked
    position holds the dtype's lowest value, never -inf (a row with every key
    masked is uniform, as the code's own softmax makes it, never NaN)."""
    if not masks:
        return None
    low = torch.finfo(dtype).min
    total: Any = None
    for m in masks:
        part = (
            torch.zeros((), dtype=dtype, device=m.device).masked_fill(~m, low)
            if m.dtype == torch.bool
            else m.to(dtype)
        )
        total = part if total is None else total + part
    return total.clamp(min=low)


def _chain(probs: Deferred) -> tuple[_Node, list[tuple[_Node, int]]] | str:
    """The product that made ``probs`` and the operations after it, in order."""
    steps: list[tuple[_Node, int]] = []
    node = probs.node
    while not node.product:
        flat = list(node.args) + list(node.kwargs.values())
        at = next((i for i, a in enumerate(node.args) if isinstance(a, Deferred)), None)
        if at is None:
            return "scores reached through a keyword argument"
        if any(isinstance(a, Deferred) for a in flat[at + 1 :]):
            # another deferred operand (a bias computed from a product): computed
            node.args = tuple(a if i == at else _real(a) for i, a in enumerate(node.args))
        steps.append((node, at))
        node = node.args[at].node
    steps.reverse()
    return node, steps


def read_attention(
    probs: Deferred, value: Any, func: Any, args: tuple[Any, ...]
) -> Attention | str:
    """``func(*args)``, a product of deferred probabilities and the values, read as
    one attention (:class:`Attention`), or why it is not one (in words)."""
    found = _chain(probs)
    if isinstance(found, str):
        return found
    product, steps = found
    for node in (product, *(n for n, _ in steps)):
        why = node.sound()
        if why is not None:
            return why
    q, k, bias, alpha = product.query, product.key, product.bias, product.alpha
    reading = _Reading(product.shape)
    reading.scale = alpha
    if bias is not None:
        why = _add(reading, bias, 1.0, "baddbmm")
        if why is not None:
            return why
    for node, at in steps:
        why = _step(reading, node, at)
        if why is not None:
            return why
    if not reading.softmax:
        return "no softmax of the scores"
    if not reading.attention_shaped():
        return f"probabilities viewed as {list(reading.shape)}"
    if reading.zeroed:
        masked = _mask(reading.masks, torch.float32)
        for zero in reading.zeroed:
            if masked is None or not bool(((masked <= _MASKED) | ~zero).all()):
                return "mul by a tensor"
    lead = reading.shape[:-2]
    seq_q, seq_kv = reading.shape[-2:]
    # the values, as (lead..., seq_kv, size)
    if func is _EINSUM:
        eq, _, v_in = _einsum_operands(args)  # type: ignore[misc]
        spec = _Einsum(eq, probs.dim(), v_in.dim())
        if not spec.valid(probs, v_in):
            return f"einsum {eq!r} of the probabilities"
        v = spec.arrange(v_in, spec.rhs, spec.col[0])

        def finish(out: Any) -> Any:
            return spec.output(out)
    else:
        v = value

        def finish(out: Any) -> Any:
            return out

    if v.dim() != len(lead) + 2 or v.shape[-2] != seq_kv:
        return f"values of shape {list(v.shape)} for scores of shape {list(reading.shape)}"
    if not q.dtype == k.dtype == v.dtype == probs.like_dtype:
        # the code casts the probabilities or the values (its product runs in the
        # cast dtype): one kernel call takes one dtype
        dtypes = (str(t).removeprefix("torch.") for t in (q.dtype, probs.like_dtype, v.dtype))
        return "scores in {}, probabilities in {}, values in {}".format(*dtypes)
    try:
        v = v.expand(*lead, *v.shape[-2:])
        q = q.expand(*product.shape[:-2], *q.shape[-2:]).reshape(*lead, seq_q, -1)
        k = k.expand(*product.shape[:-2], *k.shape[-2:]).reshape(*lead, seq_kv, -1)
        if reading.factor is not None:
            q = q * reading.factor.expand(*lead, seq_q, 1).to(q.dtype)
    except RuntimeError:
        return "query, keys and values whose batches do not agree"
    n = len(reading.shape)
    mask = _mask([m.reshape((1,) * (n - m.dim()) + tuple(m.shape)) for m in reading.masks], q.dtype)
    return Attention(q, k, v, mask, reading.scale, reading.dropout, finish)


# =============================================================================
# The mode
# =============================================================================


Runner = Callable[[Attention], Any]


class DeferScores(TorchFunctionMode):
    """While active (one site's forward): products shaped like attention scores
    are deferred, the operations on them recorded, and a product of deferred
    probabilities with the values is handed to ``run`` as one attention
    (``run`` returns the product's result, or ``None``: the site's own math)."""

    def __init__(self, run: Callable[[Attention | str, Any], Any]) -> None:
        super().__init__()
        self.run = run
        #: attentions handed to ``run``
        self.handed = 0
        #: the query and keys of the last product deferred (None: none was)
        self.last: tuple[Any, Any] | None = None
        #: the first operation that computed deferred scores (its name): what a
        #: forward in which no attention was read did to them
        self.computed_by: str | None = None
        #: why no product was deferred (autocast), if that is why
        self.reason: str | None = None
        #: recorded operations not computed yet, and the storages of the tensors
        #: they read: a change in place of one computes them first (as the code did)
        self.pending: list[_Node] = []
        self.storages: set[int] = set()

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        args = tuple(args)
        if not (_has_deferred(args) or (kwargs and _has_deferred(tuple(kwargs.values())))):
            if self.pending and _mutates(func, kwargs):
                self._written(func, args, kwargs)
            if func in MATMULS and len(args) >= 2 and not kwargs:
                if _is_scores_product(args[0], args[1]):
                    return self._product(func, args, kwargs, args[0], args[1].transpose(-1, -2))
            elif func in _BADDBMM:
                return self._baddbmm(func, args, kwargs)
            elif func is _EINSUM:
                return self._einsum(func, args, kwargs)
            return func(*args, **kwargs)
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        shaped = func in _SHAPED and len(args) == 2 and not kwargs
        if shaped and type(args[1]) is Deferred and not isinstance(args[0], Deferred):
            return _SHAPED[func](args[0], args[1])  # the scores' shape only: a mask expanded
        if (
            func in MATMULS
            and len(args) == 2
            and isinstance(args[0], Deferred)
            and not isinstance(args[1], Deferred)
        ):
            return self._attention(args[0], args[1], func, args, kwargs)
        if (
            func in MATMULS
            and len(args) == 2
            and not isinstance(args[0], Deferred)
            and isinstance(args[1], Deferred)
        ):
            probs = _swap_of(args[1].node.func, args[1].node.args, args[1].node.kwargs)
            if probs is not None and not kwargs:
                # v' @ p^T = (p @ v'^T)^T
                value = args[0].transpose(-1, -2)
                return self._attention(probs, value, func, (probs, value), kwargs, args)
        if func is _EINSUM:
            found = _einsum_operands(args)
            if (
                found is not None
                and isinstance(found[1], Deferred)
                and not isinstance(found[2], Deferred)
            ):
                return self._attention(found[1], found[2], func, args, kwargs)
        return self._record(func, args, kwargs)

    def _product(
        self,
        func: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        q: Any,
        k: Any,
        bias: Any = None,
        alpha: float = 1.0,
    ) -> Any:
        if torch.is_autocast_enabled(q.device.type):
            # autocast picks each operation's dtype as it runs: the code's own math
            self.reason = self.reason or "scores under autocast"
            return func(*args, **kwargs)
        shape, dtype = _infer(func, args, kwargs)
        node = _Node(func, args, kwargs, shape)
        node.product = True
        node.query, node.key, node.bias, node.alpha = q, k, bias, alpha
        self._pend(node)
        self.last = (q, k)
        return Deferred(node, _Like(shape, dtype, q.device))

    def _pend(self, node: _Node) -> None:
        node.note_read()
        for t, _ in node.read:
            self.storages.add(_storage(t))
        self.pending.append(node)

    def _written(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        """An in-place operation on real tensors: where it writes one that shares
        storage with a tensor a recorded operation read, every recorded operation is
        computed first (as the code computed it), and the ones that read it are the
        code's own math from then on (an inference tensor has no version to tell)."""
        targets = {_storage(t) for t in _tensors((args[:1], kwargs.get("out")), [])}
        if not targets & self.storages and -1 not in targets:
            return
        name = getattr(func, "__name__", str(func))
        for node in self.pending:
            read = [t for t, _ in node.read if _storage(t) in targets or -1 in targets]
            if read and node.seen is None:
                node.seen = (
                    f"a tensor of shape {list(read[0].shape)} it read changed in place after "
                    f"its use ({name})"
                )
        self._materialize()

    def _materialize(self) -> None:
        """Compute every recorded operation now (before the code changes in place
        something they read, or what they are)."""
        for node in self.pending:
            node.compute()
        self.pending.clear()

    def _baddbmm(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        names = ("input", "batch1", "batch2")
        given = dict(zip(names, args, strict=False)) | kwargs
        a, b, bias = given.get("batch1"), given.get("batch2"), given.get("input")
        beta, alpha = _number(given.get("beta", 1.0)), _number(given.get("alpha", 1.0))
        if (
            a is None
            or b is None
            or not _is_scores_product(a, b)
            or not isinstance(bias, torch.Tensor)
            or beta is None
            or alpha is None
            or len(args) > 3
        ):
            return func(*args, **kwargs)
        # beta 0: the input is ignored (torch.baddbmm: nan and inf in it are not
        # propagated; diffusers' get_attention_scores passes torch.empty then)
        added = None if beta == 0 else bias if beta == 1.0 else bias * beta
        return self._product(func, args, kwargs, a, b.transpose(-1, -2), added, alpha)

    def _einsum(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        found = _einsum_operands(args)
        if found is None or kwargs:
            return func(*args, **kwargs)
        eq, a, b = found
        if type(a) is not torch.Tensor or type(b) is not torch.Tensor:
            return func(*args, **kwargs)
        spec = _Einsum(eq, a.dim(), b.dim())
        if not spec.valid(a, b):
            return func(*args, **kwargs)
        q = spec.arrange(a, spec.lhs, spec.contracted[0])
        k = spec.arrange(b, spec.rhs, spec.contracted[0])
        if q.shape[-1] == 1:
            return func(*args, **kwargs)
        # the scores in (batch..., row, col): the output's order is a permutation
        have = [*spec.batch, spec.row[0], spec.col[0]]
        if list(spec.out) != have:
            return func(*args, **kwargs)
        return self._product(func, args, kwargs, q, k)

    def _record(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        understood = (
            func in _KEEP
            or func in _VIEWS
            or func in SOFTMAXES
            or func in _MULS
            or func in _DIVS
            or func in _ADDS
            or func in _SUBS
            or func in _FILLS
            or func in _WHERE
            or func in _DROPOUT
            or func in _FLOORS
            or (func in _SWAPS and _swap_of(func, args, kwargs) is not None)
        )
        in_place = func in _IN_PLACE and args and isinstance(args[0], Deferred)
        if understood and in_place:
            # followed in place only where nothing else sees the change: scores no
            # recorded operation has read yet, that alias nothing
            target = args[0].node
            understood = not (target.uses or target.alias or target.value is not None)
        if understood:
            try:
                shape, dtype = _infer(func, args, kwargs)
            except (RuntimeError, TypeError, ValueError, NotImplementedError):
                understood = False
        if not understood:
            return self._own(func, args, kwargs)
        node = _Node(func, args, kwargs, shape)
        deferred = [a for a in (*args, *kwargs.values()) if isinstance(a, Deferred)]
        for d in deferred:
            d.node.uses += 1
        node.alias = func in _VIEWS or func in _SWAPS or func in _ALIASES or func in _DROPOUT
        self._pend(node)
        if in_place:
            # in place: the deferred tensor itself now stands for the result
            before = Deferred(args[0].node, _Like(shape, dtype, deferred[0].device))
            node.args = (before, *args[1:])
            args[0].node = node
            return args[0]
        return Deferred(node, _Like(shape, dtype, deferred[0].device))

    def _own(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """What the route does not model, done to deferred tensors: computed as the
        code computes it, and the scores it saw are the code's own math from then
        on (their values, autograd state or hooks are the code's)."""
        name = getattr(func, "__name__", str(func))
        if name == "__get__":  # a property read: its name (requires_grad, grad_fn ...)
            name = getattr(getattr(func, "__self__", None), "__name__", name)
        if self.computed_by is None:
            self.computed_by = name
        if _mutates(func, kwargs):
            self._materialize()
        for a in _deferred_in((args, kwargs), []):
            if a.node.seen is None:
                a.node.seen = f"{name} of the scores"
        return func(*_real(args), **_real(kwargs))

    def _attention(
        self,
        probs: Deferred,
        value: Any,
        func: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        swapped: tuple[Any, ...] | None = None,
    ) -> Any:
        """``func(*args)`` of deferred probabilities and the values, handed to the
        route as one attention; ``swapped``: the code's own arguments, where it
        computed ``v' @ p^T`` (read as ``(p @ v'^T)^T``)."""
        found = read_attention(probs, value, func, args) if not kwargs else "keyword arguments"
        if swapped is not None and isinstance(found, Attention):
            finish = found.finish
            found.finish = lambda out: finish(out).transpose(-1, -2)
        self.handed += 1
        out = self.run(found, probs)
        if out is not None:
            return out
        own = args if swapped is None else swapped
        return func(*_real(own), **_real(kwargs))


def deferred_operands(probs: Any) -> tuple[Any, Any] | None:
    """The query and keys of the product deferred ``probs`` come from, if any."""
    node = probs.node if isinstance(probs, Deferred) else None
    while node is not None and not node.product:
        node = next((a.node for a in node.args if isinstance(a, Deferred)), None)
    return None if node is None else (node.query, node.key)
