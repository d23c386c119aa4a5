"""The generic route: a site that calls SDPA itself runs the attnres kernel it was decided.

- **Observation of code** (:func:`calls_of`): which attention entry points a
  function's code names (``scaled_dot_product_attention``,
  ``dispatch_attention_fn``, ``ALL_ATTENTION_FUNCTIONS``, a softmax...), read
  from its code objects and those of the module-level functions it calls. A
  site is found by what its code calls, never by its class name.
- **Head facts** (:func:`head_facts`): read from what the module holds;
  ``None``: the site is decided at its first call.
- **Call facts** (:class:`CallFacts`): what one SDPA call brings besides its
  values (its mask as :class:`MaskFacts`).
- **The route** (:class:`GenericRoute`): installed on one module (nothing
  process-wide), it takes the SDPA or dispatcher calls its code names and runs
  the decided kernel. One install mechanism (issue 30, :func:`rebind`): a copy
  of each method of the site's that names those calls, whose global names for
  them are read under names of the route's own, set on the instance where it
  reaches that method (:func:`reroutes`). A site no copy can take is planned as
  a pin: it runs its own code. The planned call
  signature is bound at install time; a new one re-resolves the site through
  the machine (traced; a strict component raises
  :class:`~attnres.errors.ResolutionError`). A signature decided what the site
  runs already calls the original SDPA with the original arguments.
"""

from __future__ import annotations

import ast
import copy
import dis
import functools
import inspect
import math
import sys
import textwrap
import threading
import types
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NoReturn

import attrs
import torch
from attrs import frozen
from torch.overrides import TorchFunctionMode

from attnres._varlen import (
    check_layer_options,
    observe_mask,
    refuse_integer_mask,
    route_kernel,
)
from attnres._vocab import MaskKind, normalize_dtype
from attnres.backends import Backend, lookup_spec
from attnres.errors import (
    AppliedModelPickleError,
    CompiledGraphError,
    InvalidStateError,
    ResolutionError,
)
from attnres.integrations._plan import RouteKind, Site, SiteDescription
from attnres.kernels import get_kernel
from attnres.layer import LayerSpec, Requirements, SelectionConfig
from attnres.platform import Platform
from attnres.runtime import Resolution, lookup
from attnres.scope import ScopeState, scope_state
from attnres.trace import Trace

__all__ = [
    "CallFacts",
    "FirstCall",
    "GenericRoute",
    "MaskFacts",
    "calls_of",
    "head_facts",
    "install_route",
    "installed_route",
    "mha_forward",
    "remove_route",
    "restore_route",
    "site_route",
    "unflagged",
    "watch_forward",
]

_SDPA = torch.nn.functional.scaled_dot_product_attention
_TORCH_SDPA = Backend("torch_sdpa")

#: the names a function's code may call that say how it computes attention
SDPA = "scaled_dot_product_attention"
DISPATCHER = "dispatch_attention_fn"
INTERFACE = "ALL_ATTENTION_FUNCTIONS"
#: names that mean softmax attention computed by hand (``AttnProcessor``'s
#: ``get_attention_scores``, a ``softmax`` of a ``baddbmm``)
BY_HAND = frozenset({"get_attention_scores", "softmax", "baddbmm"})
_EAGER = Backend("eager")
#: issue 30: the products and softmaxes :class:`_Watch` reads a by-hand site's
#: head facts from (it reads their operands' shapes, and changes nothing); tuples,
#: as the floor's dynamo (torch 2.6) traces ``in`` over a tuple, not a frozenset
_MATMULS = (torch.matmul, torch.bmm, torch.Tensor.matmul, torch.Tensor.bmm, torch.Tensor.__matmul__)
_SOFTMAXES = (
    torch.softmax,
    torch.nn.functional.softmax,
    torch.Tensor.softmax,
    torch.special.softmax,
)
#: ``nn.Module.__call__``'s frames: one between a call :class:`_Watch` meets and
#: the watched forward is a module called inside that forward (a nested module)
_MODULE_CALLS = frozenset(
    {torch.nn.Module._wrapped_call_impl.__code__, torch.nn.Module._call_impl.__code__}
)


def _codes(code: types.CodeType) -> Iterator[types.CodeType]:
    """``code`` and the code objects it holds (nested functions, comprehensions)."""
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def calls_of(functions: Iterable[Any], depth: int = 2) -> frozenset[str]:
    """Every global or attribute name the code of ``functions`` names, following
    module-level Python functions it calls ``depth`` levels down."""
    seen: set[int] = set()
    names: set[str] = set()
    todo = [(f, 0) for f in functions]
    while todo:
        func, level = todo.pop()
        func = getattr(func, "__func__", func)
        wrapped = getattr(func, "__wrapped__", None)
        if wrapped is not None:  # a decorated method: its own code is the wrapped one
            todo.append((wrapped, level))
        code = getattr(func, "__code__", None)
        if not isinstance(code, types.CodeType) or id(code) in seen:
            continue
        seen.add(id(code))
        own = {name for c in _codes(code) for name in c.co_names}
        names |= own
        if level >= depth:
            continue
        glob = getattr(func, "__globals__", {})
        for name in own:
            value = glob.get(name)
            if isinstance(value, types.FunctionType):
                todo.append((value, level + 1))
    return frozenset(names)


def methods_of(obj: Any, skip: frozenset[type] = frozenset()) -> dict[str, types.FunctionType]:
    """The methods (as its class resolves them) of ``obj``'s own classes: not
    torch's, nor those in ``skip`` (the bases every transformers model shares)."""
    cls = obj if isinstance(obj, type) else type(obj)
    owner: dict[str, tuple[type, Any]] = {}
    for k in cls.__mro__:  # each name as the class resolves it: its first definer's
        for name, value in vars(k).items():
            owner.setdefault(name, (k, value))
    return {
        name: value
        for name, (k, value) in owner.items()
        if isinstance(value, types.FunctionType) and not (_torchs(k) or k in skip)
    }


def _torchs(cls: type) -> bool:
    return cls.__module__.startswith("torch.") or cls is object


_HEADS = ("heads", "num_heads", "n_heads", "num_attention_heads", "attention_heads")
_KV_HEADS = ("kv_heads", "num_key_value_heads", "num_kv_heads")
_HEAD_SIZE = ("head_dim", "dim_head", "head_size", "attention_head_size", "key_value_proj_dim")


def _int_attr(obj: Any, names: Iterable[str]) -> int | None:
    for name in names:
        value = getattr(obj, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def head_facts(module: Any) -> tuple[int, int, int] | None:
    """``(heads, kv_heads, head_size)`` from what ``module`` holds, or ``None``."""
    heads = _int_attr(module, _HEADS)
    if heads is None:
        return None
    size = _int_attr(module, _HEAD_SIZE[:1])
    inner = _int_attr(module, ("inner_dim",))
    if size is None and inner is not None and inner % heads == 0:
        size = inner // heads
    if size is None:
        size = _int_attr(module, _HEAD_SIZE[1:])
    if size is None:
        return None
    kv = _int_attr(module, _KV_HEADS)
    return heads, (kv if kv is not None and heads % kv == 0 else heads), size


def source_tree(func: Any) -> ast.Module | None:
    """The parsed source of a function or method (``None`` where it cannot be
    read), the one reader of code text the routes use; parsed once per code
    object (immutable, so never stale: a reloaded module brings new ones)."""
    try:  # a decorated function's own code is the wrapped one (as getsource reads it)
        target = inspect.unwrap(getattr(func, "__func__", func))
    except ValueError:  # a __wrapped__ cycle
        return None
    code = getattr(target, "__code__", None)
    return _parse_code(code) if isinstance(code, types.CodeType) else None


@functools.lru_cache(maxsize=512)
def _parse_code(code: types.CodeType) -> ast.Module | None:
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(code)))
    except (OSError, TypeError, SyntaxError):
        return None


def self_calls(tree: ast.AST, attr: str) -> Iterator[ast.Call]:
    """The calls ``self.<attr>(...)`` in parsed code (:func:`source_tree`): what a
    module or pipeline passes the submodule it holds as ``attr``."""
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == attr
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "self"
        ):
            yield node


def mha_weights_asked(parent: Any, name: str) -> str | None:
    """How the code of ``parent`` asks the ``torch.nn.MultiheadAttention`` it holds
    (qualified ``name``, last part ``attr``) for the attention weights: a call
    ``self.<attr>(...)`` leaving ``need_weights`` at torch's default (``True``) or
    passing ``True``, read from source so that a plan knows what SigLIP's pooling
    head asks before anything runs (``None``: no such call, or source or value
    not readable; the site's first call then checks it)."""
    attr = name.rpartition(".")[2]
    for func in methods_of(parent).values():
        tree = source_tree(func)
        if tree is None:
            continue
        for node in self_calls(tree, attr):
            given = [k.value for k in node.keywords if k.arg == "need_weights"]
            value = given[0] if given else None
            if value is not None and not isinstance(value, ast.Constant):
                continue  # decided at the call: the first-call check sees it
            if len(node.args) >= 5 or any(isinstance(a, ast.Starred) for a in node.args):
                continue  # passed by position (after key_padding_mask) or unpacked
            if any(k.arg is None for k in node.keywords):  # **kwargs: cannot tell
                continue
            if value is None or value.value is True:
                how = "left at its default (True)" if not given else "True"
                return (
                    f"{type(parent).__name__}.{func.__name__} calls it with "
                    f"need_weights {how}: the attention weights are returned"
                )
    return None


def describe_mha(
    component: str, name: str, module: Any, dtype: str, backward: bool, parent: Any = None
) -> SiteDescription:
    """A ``torch.nn.MultiheadAttention``: its own math runs on the MHA route
    (:func:`mha_forward`), which runs any kernel; with no flag nothing is wrapped.
    A module whose math has a fact no kernel takes (a key and value appended to
    every sequence), or whose caller (``parent``, :func:`mha_weights_asked`) asks
    for the attention weights, keeps its own code path only, and says which."""
    fact = None
    if getattr(module, "bias_k", None) is not None:
        fact = "add_bias_kv (a learned key and value appended to every sequence)"
    elif getattr(module, "add_zero_attn", False):
        fact = "add_zero_attn (a zero key and value appended to every sequence)"
    asked = None if fact is not None or parent is None else mha_weights_asked(parent, name)
    # only: the one backend a site of its own code path runs (None: the MHA route)
    if asked is not None:
        # torch's own path computes the weights by hand (eager math). Issue 19: a
        # requirement only eager implements (``machine.REQUIREMENTS_BEFORE_SUPPORTED``)
        only, route = _EAGER, f"{WEIGHTS_ROUTE}: {asked}"
    elif fact is not None:
        only = _TORCH_SDPA
        route = f"torch_sdpa in torch.nn.MultiheadAttention (its own code path: {fact})"
    else:
        only, route = None, f"{MHA_ROUTE} (torch.nn.MultiheadAttention's own math)"
    heads = int(module.num_heads)
    return SiteDescription(
        component=component,
        name=name,
        module_class=type(module).__name__,
        head_size=int(module.head_dim),
        heads=heads,
        kv_heads=heads,
        dtype=dtype,
        requirements=Requirements(backward=backward, weights=asked is not None),
        current=only or _TORCH_SDPA,
        route=route,
        kind=RouteKind.INTERCEPT if only is None else RouteKind.PIN,
        supported=None if only is None else frozenset({only}),
        # with no flag, automatic choices keep what torch runs there (nothing wrapped)
        preferred=frozenset({_TORCH_SDPA}) if only is None else None,
    )


#: issue 30: torch's functional multi-head attention (HunyuanDiT's attention pool
#: calls it with its own projections)
MHA_FUNCTION = "multi_head_attention_forward"


def describe_mha_function(
    component: str, name: str, module: Any, dtype: str, backward: bool
) -> SiteDescription:
    """A module whose code calls ``F.multi_head_attention_forward`` (issue 30): a
    site of its own code path (torch SDPA, no other kernel: an explicit backend
    falls back with the reason, or is refused in a strict component). Head facts
    from a head count and a head size or its query projection's width; without
    them the site is unclassified, which a strict component refuses."""
    cls = type(module).__name__
    facts = head_facts(module)
    count = _int_attr(module, _HEADS)
    width = getattr(getattr(module, "q_proj", None), "out_features", None)
    if facts is None and count is not None and isinstance(width, int) and width % count == 0:
        facts = (count, count, width // count)
    heads, kv_heads, size = facts or (None, None, None)
    function = f"torch.nn.functional.{MHA_FUNCTION}"
    return SiteDescription(
        component=component,
        name=name,
        module_class=cls,
        dtype=dtype,
        route=f"torch_sdpa in {function} (its own code path: {cls} calls it)",
        kind=RouteKind.PIN,
        current=_TORCH_SDPA,
        requirements=Requirements(backward=backward),
        supported=frozenset({_TORCH_SDPA}),
        heads=heads,
        kv_heads=kv_heads,
        head_size=size,
        why=None if facts else f"{cls} calls {function} and holds no head count and head size",
    )


#: the route of a ``torch.nn.MultiheadAttention`` site
MHA_ROUTE = "generic route"
#: the route a call that returns its attention weights is limited to
WEIGHTS_ROUTE = "torch.nn.MultiheadAttention returning attention weights (its own code path)"
#: the route a call with attention dropout is limited to
DROPOUT_ROUTE = "the site's own code (attention dropout: attnres kernels take no dropout)"
#: issue 19: a transformers call passing arguments attnres's function cannot hand
#: to a kernel runs only the model's own eager function
ARGUMENTS_ROUTE = "transformers' own eager attention (call arguments no attnres kernel takes)"


def by_hand_route(owner: str) -> str:
    """Issue 30: the route of softmax attention ``owner``'s code computes by hand:
    the site's own code, untouched. No kernel is offered there (a capture of
    hand-written attention is not sound by construction): its spec runs exactly
    ``eager``, which the machine reads as ``attnres.machine.written_by_hand``."""
    return f"the site's own code (softmax attention written by hand in {owner})"


# =============================================================================
# What a call brings
# =============================================================================


@frozen
class MaskFacts:
    """The attention mask one call passed: present, its dtype and shape, and its
    kind (issue 22: :func:`attnres._varlen.observe_mask`; planned: the site's
    declared kind)."""

    present: bool
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    kind: MaskKind = MaskKind.NONE
    #: the mask also holds a top-left causal triangle (observed key padding)
    causal: bool = False

    def describe(self) -> str:
        if not self.present:
            return "no attention mask"
        words = _MASK_WORDS[self.kind]
        if self.causal:
            words = f"causal with {words}"
        return f"{words} ({self.dtype}, shape {list(self.shape or ())})"

    def covered_by(self, planned: MaskFacts) -> bool:
        """Whether a site planned for ``planned`` takes this mask (issue 22)."""
        return not self.present or (planned.present and planned.kind in (MaskKind.ANY, self.kind))


_MASK_WORDS = {
    MaskKind.NONE: "no attention mask",
    MaskKind.KEY_PADDING: "key-padding mask",
    MaskKind.BOOLEAN: "boolean mask",
    MaskKind.ADDITIVE: "additive mask",
    MaskKind.ANY: "attention mask",
}


def _is_block_mask(attn_mask: Any) -> bool:
    from torch.nn.attention.flex_attention import BlockMask

    return isinstance(attn_mask, BlockMask)


def dense_mask(attn_mask: Any, q: Any, k: Any, seq_dim: int) -> Any:
    """A flex ``BlockMask`` as the boolean mask it stands for (its ``mask_mod`` over
    every query and key position of the call; True: attend), for a kernel that
    takes a dense mask (issue 19: a processor that builds a BlockMask for flex
    only, as AnyFlow FAR's and the LTX-2 diffusion decoder's). Any other mask is
    returned as it is."""
    if attn_mask is None or not _is_block_mask(attn_mask):
        return attn_mask
    from torch.nn.attention.flex_attention import create_mask

    batch, heads = attn_mask.shape[:2]
    seq_q, seq_kv = int(q.shape[seq_dim]), int(k.shape[seq_dim])
    return create_mask(attn_mask.mask_mod, batch, heads, seq_q, seq_kv, device=q.device)


def dispatcher_mask(attn_mask: Any, query: Any, key: Any) -> Any:
    """A mask as diffusers' ``dispatch_attention_fn`` reads it (issue 32 item 4):
    its native backend takes a 2-D mask of shape (batch, key length) as key
    padding, (batch, 1, 1, key length), where torch's SDPA would read a 2-D mask
    as (query length, key length). Diffusers 0.38's QwenImage ControlNet passes
    its joint prompt mask in that form. The dispatcher's layout is (batch, seq,
    heads, dim). Any other mask is returned as it is."""
    if (
        isinstance(attn_mask, torch.Tensor)
        and attn_mask.dim() == 2
        and query.dim() == 4
        and key.dim() == 4
        and attn_mask.shape[0] == query.shape[0]
        and attn_mask.shape[1] == key.shape[1]
    ):
        return attn_mask[:, None, None, :]
    return attn_mask


def _observe_mask(q: Any, k: Any, attn_mask: Any, heads_dim: int) -> MaskFacts:
    """The mask of one call as :class:`MaskFacts`, its kind observed (issue 22)."""
    if attn_mask is None:
        return MaskFacts(False)
    shape = tuple(int(d) for d in attn_mask.shape)
    if _is_block_mask(attn_mask):
        # a flex BlockMask: a boolean mask over arbitrary positions (its mask_mod),
        # told without building it
        return MaskFacts(True, "bool", shape, MaskKind.BOOLEAN)
    seen = observe_mask(attn_mask, *_mask_dims(q, k, heads_dim))
    return MaskFacts(True, _dtype_name(attn_mask.dtype), shape, seen.kind, seen.causal)


def _mask_dims(q: Any, k: Any, heads_dim: int) -> tuple[int, int, int]:
    """A call's batch, query and key lengths (SDPA: (B, H, S, D); dispatcher: (B, S, H, D))."""
    seq_dim = -2 if heads_dim == -3 else -3
    batch = int(q.shape[0]) if q.dim() == 4 else 1
    return batch, int(q.shape[seq_dim]), int(k.shape[seq_dim])


@frozen
class CallFacts:
    """What one SDPA call of a site brings besides its values."""

    heads: int
    kv_heads: int
    head_size: int
    dtype: str
    mask: MaskFacts
    causal: bool
    custom_scale: bool
    dropout: bool
    #: the caller asks for the attention weights (``need_weights=True``): only the
    #: site's own code path computes them
    weights: bool = False
    #: issue 19: call arguments attnres's transformers function cannot hand to a
    #: kernel (``softcap``, attention sinks ...): only the site's own code serves them
    arguments: tuple[str, ...] = ()

    @classmethod
    def observe(
        cls,
        q: Any,
        k: Any,
        attn_mask: Any,
        dropout_p: float,
        is_causal: bool,
        scale: float | None,
        heads_dim: int = -3,
        weights: bool = False,
        arguments: tuple[str, ...] = (),
    ) -> CallFacts:
        head_size = int(q.shape[-1])
        return cls(
            heads=int(q.shape[heads_dim]) if q.dim() >= 3 else 1,
            kv_heads=int(k.shape[heads_dim]) if k.dim() >= 3 else 1,
            head_size=head_size,
            dtype=_dtype_name(q.dtype),
            mask=_observe_mask(q, k, attn_mask, heads_dim),
            causal=bool(is_causal),
            custom_scale=scale is not None and _custom(scale, head_size),
            dropout=bool(dropout_p),
            weights=weights,
            arguments=arguments,
        )

    @classmethod
    def planned(cls, spec: LayerSpec, heads: int, kv_heads: int) -> CallFacts:
        req = spec.requirements
        return cls(
            heads=heads,
            kv_heads=kv_heads,
            head_size=spec.head_size,
            dtype=spec.dtype,
            mask=MaskFacts(req.attn_mask, kind=req.mask),
            causal=req.causal,
            custom_scale=req.custom_scale,
            dropout=req.dropout,
        )

    def key(self) -> tuple[Any, ...]:
        """What decides a kernel (the mask's shape does not; its kind does): the
        same tuple :meth:`GenericRoute.kernel_for` builds from a call's tensors."""
        return (
            self.heads,
            self.kv_heads,
            self.head_size,
            getattr(torch, self.dtype),
            (self.mask.kind, self.mask.causal) if self.mask.present else False,
            self.causal,
            self.custom_scale,
            self.dropout,
            self.weights,
            self.arguments,
        )

    def differences(self, planned: CallFacts | None) -> tuple[str, ...]:
        """The facts that differ from ``planned``, in words (all, when nothing was)."""
        if planned is None:
            return ("head facts (decided at first call)",)
        # less than the plan allowed is no difference: no mask where it allowed one,
        # the default scale, as many kv heads as heads (a processor repeats them)
        out = []
        if not self.mask.covered_by(planned.mask):
            out.append(self.mask.describe())
        # a causal triangle inside a key-padding mask is causal (as :meth:`spec` reads it)
        causal = self.causal or self.mask.causal
        if causal != planned.causal:
            out.append("causal" if causal else "not causal")
        if self.custom_scale and not planned.custom_scale:
            out.append("custom softmax scale")
        if self.head_size != planned.head_size:
            out.append(f"head size {self.head_size} (planned {planned.head_size})")
        grouped = self.kv_heads < self.heads
        if grouped and self.kv_heads * planned.heads != planned.kv_heads * self.heads:
            out.append(f"{self.kv_heads} kv heads for {self.heads} heads")
        if self.dtype != planned.dtype:
            out.append(f"dtype {self.dtype} (planned {planned.dtype})")
        if self.dropout != planned.dropout:
            out.append("dropout" if self.dropout else "no dropout")
        if self.weights != planned.weights:
            out.append(
                "attention weights returned (need_weights=True)"
                if self.weights
                else "no attention weights returned"
            )
        if self.arguments != planned.arguments:
            out.append("call arguments " + ", ".join(self.arguments or ("none",)))
        if not out and self.heads != planned.heads:  # same grouping, other head count
            out.append(f"{self.heads} heads (planned {planned.heads})")
        return tuple(out)

    def spec(self, planned: LayerSpec | None, name: str, own: Backend = _TORCH_SDPA) -> LayerSpec:
        """The site's layer spec with these facts (``own``: what the site's own code
        runs, the only path for a call no attnres kernel can serve)."""
        base = planned if planned is not None else LayerSpec(self.head_size, self.dtype, name=name)
        req = attrs.evolve(
            base.requirements,
            attn_mask=self.mask.present,
            # issue 22: the observed kind (a causal triangle inside the mask is causal)
            mask=self.mask.kind if self.mask.present else MaskKind.NONE,
            causal=self.causal or self.mask.causal,
            custom_scale=self.custom_scale,
            dropout=self.dropout,
            gqa=self.kv_heads < self.heads,
            softcap=base.requirements.softcap or "softcap" in self.arguments,
            sinks=base.requirements.sinks or bool({"s_aux", "sinks"} & set(self.arguments)),
            weights=base.requirements.weights or self.weights,
        )
        spec = attrs.evolve(base, head_size=self.head_size, dtype=self.dtype, requirements=req)
        # no attnres kernel returns the weights, applies dropout or takes these
        # arguments (the calling convention has none of them): only the site's own
        # code serves the call, exactly (a stand-in never runs there)
        if self.arguments:
            only, route = _EAGER, f"{ARGUMENTS_ROUTE}: {', '.join(self.arguments)}"
        elif self.weights:
            only, route = _EAGER, WEIGHTS_ROUTE
        elif self.dropout:
            only, route = own, DROPOUT_ROUTE
        else:
            return spec
        default = None if base.default is None else only
        return attrs.evolve(
            spec, supported=frozenset({only}), default=default, preferred=None, exact_route=route
        )


def mask_kind(q: Any, k: Any, attn_mask: Any, heads_dim: int) -> Any:
    """Issue 30: a call's mask in its signature: ``False`` (none), else its kind and
    whether it holds a causal triangle, read once per mask tensor (every layer of
    a forward is handed the same one)."""
    if attn_mask is None:
        return False
    if _is_block_mask(attn_mask):
        return (MaskKind.BOOLEAN, False)
    dims = _mask_dims(q, k, heads_dim)
    key = (id(attn_mask), attn_mask._version, *dims, heads_dim)
    held = _MASKS_SEEN.get(key)
    if held is not None and held[0]() is attn_mask:
        return held[1]
    seen = observe_mask(attn_mask, *dims)
    kind = (seen.kind, seen.causal)
    if len(_MASKS_SEEN) >= 64:
        _MASKS_SEEN.clear()
    _MASKS_SEEN[key] = (weakref.ref(attn_mask), kind)
    return kind


#: the masks :func:`mask_kind` read lately: (id, version, batch, seq_q, seq_kv,
#: layout) -> (the tensor, weakly; its kind)
_MASKS_SEEN: dict[tuple[int, ...], tuple[Any, Any]] = {}


def _dtype_name(dtype: Any) -> str:
    try:
        return normalize_dtype(dtype)
    except ValueError:
        return str(dtype).removeprefix("torch.")


def _custom(scale: float, head_size: int) -> bool:
    default = 1.0 / math.sqrt(head_size)
    return abs(float(scale) - default) > 1e-6 * default


@frozen
class FirstCall:
    """A call signature a site met that its plan did not describe, and its outcome.

    ``changed`` names the facts that differed (``observed at first call: ...``);
    ``trace`` is the machine's trace of the re-resolution; ``backend`` is what
    runs for this signature (``None``: rejected, ``error`` says why).
    """

    component: str
    site: str
    facts: CallFacts
    changed: tuple[str, ...]
    trace: Trace = attrs.field(eq=False, repr=False)
    backend: Backend | None
    error: str | None = None

    def describe(self) -> str:
        return f"observed at first call: {', '.join(self.changed)}"


# =============================================================================
# The route
# =============================================================================


_KernelFn = Callable[..., Any]
#: a signature no kernel was decided for yet
_UNSEEN: Any = object()


class GenericRoute:
    """One site's route: its SDPA calls run the kernel decided for their signature."""

    def __init__(
        self,
        *,
        component: str,
        name: str,
        spec: LayerSpec | None,
        heads: int | None,
        kv_heads: int | None,
        resolution: Resolution | None,
        config: SelectionConfig,
        scope: ScopeState,
        platform: Platform,
        own: Backend | None = None,
        own_route: str | None = None,
    ) -> None:
        self.component = component
        self.where = f"attention site {name!r} of component {component!r}"
        #: issue 19: the exact route of a site decided at its first call whose
        #: route runs only its own code
        self.own_route = own_route
        #: the backend the site's own code runs (torch SDPA, or ``eager`` for
        #: softmax by hand); a signature decided it runs that code, untouched
        self.own = _TORCH_SDPA if own is None else own
        self.name = name
        self.spec = spec
        self.config = config
        self.scope = scope
        self.platform = platform
        #: issue 22: the dispatcher's name for torch SDPA (set by the diffusers
        #: integration): a call decided ``torch_sdpa`` runs the dispatcher with it,
        #: never a backend pinned there (``sage_varlen`` assumes right padding)
        self.dispatch_sdpa: Any = None
        #: issue 19: a site decided at first call whose own code runs a kernel of
        #: its choosing (a processor declaring flex) keeps it with no flag
        self.keeps_own = False
        self.first_calls: list[FirstCall] = []
        #: the names its rebound functions read their stand-ins under (:func:`rebind`)
        self.homes: list[tuple[dict[str, Any], str]] = []
        #: what :meth:`close` took from the homes, for :meth:`reopen`
        self._closed: list[tuple[dict[str, Any], str, Any]] = []
        self._finalizer: weakref.finalize[Any, Any] | None = None
        self._lock = threading.Lock()
        #: call signature -> the kernel that runs it (None: the original SDPA)
        self.kernels: dict[tuple[Any, ...], _KernelFn | None] = {}
        #: issue 30: the mask of the latest call outside torch.compile (a graph
        #: cannot read a mask's values: it runs the kernel eager calls were given)
        self.last_mask: Any = None
        #: issue 30: the head facts of the calls :class:`_Watch` met in eager
        #: forwards: True where one was the site's own, False where only nested
        #: modules made it (a forward traced by torch.compile has no frames to
        #: tell them apart: it passes those by)
        self.watched: dict[tuple[Any, ...], bool] = {}
        self.planned: CallFacts | None = None
        if spec is not None and heads is not None:
            self.planned = CallFacts.planned(spec, heads, kv_heads or heads)
        if self.planned is not None and resolution is not None and spec is not None:
            kernel = self._kernel(resolution.backend, spec, self.own)
            self.kernels[self.planned.key()] = kernel
            if self.planned.mask.present:
                # a call with no mask is what the plan allowed: the same kernel, bound
                # now so that it needs no first call (torch.compile traces it whole)
                maskless = attrs.evolve(self.planned, mask=MaskFacts(False))
                self.kernels.setdefault(maskless.key(), kernel)

    def _kernel(self, backend: Backend, spec: LayerSpec, own: Backend) -> _KernelFn | None:
        if backend == own:
            return None  # what the intercepted call is: the site's own code, untouched
        kernel = get_kernel(backend.name)
        backend_spec = lookup_spec(backend)
        if kernel is None or backend_spec is None:
            raise InvalidStateError(
                f"attnres has no kernel for {backend.name!r} (unregistered after the plan was "
                f"made): register it again with attnres.kernels.register_kernel, or plan again"
            )
        # issue 22: a key-padding site on a varlen kernel runs unpad -> kernel -> pad
        req = spec.requirements
        routed: _KernelFn = route_kernel(backend_spec, kernel, req.mask, req.causal_alignment)
        options = dict(spec.backend_options).get(backend.name)
        if options:  # issue 23: the site's options for this backend, bound once
            check_layer_options(backend_spec, spec, self.platform, f" for {self.where}")
            routed = functools.partial(routed, **dict(options))
        return routed

    def __call__(
        self,
        q: Any,
        k: Any,
        v: Any,
        attn_mask: Any = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        **extra: Any,
    ) -> Any:
        """In place of ``F.scaled_dot_product_attention`` (batch, heads, seq, dim). A
        call with no heads dimension (the HunyuanImage VAE's attention block makes
        one) is one head: seen and run as (batch, 1, seq, dim)."""
        flat = q.dim() == 3
        q4, k4, v4, m4 = q, k, v, attn_mask
        if flat:
            q4, k4, v4 = q.unsqueeze(-3), k.unsqueeze(-3), v.unsqueeze(-3)
            if attn_mask is not None and attn_mask.dim() == 3:
                m4 = attn_mask.unsqueeze(-3)
        kernel = self.kernel_for(q4, k4, m4, dropout_p, is_causal, scale, -3)
        if kernel is None:
            return _SDPA(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, **extra)
        # the kernels' layout (batch, seq, heads, dim), with no list or unpacking per call
        out = kernel(
            q4.transpose(-3, -2), k4.transpose(-3, -2), v4.transpose(-3, -2), m4, is_causal, scale
        ).transpose(-3, -2)
        return out.squeeze(-3) if flat else out

    def kernel_for(
        self,
        q: Any,
        k: Any,
        attn_mask: Any,
        dropout_p: float,
        is_causal: bool,
        scale: float | None,
        heads_dim: int,
        weights: bool = False,
        arguments: tuple[str, ...] = (),
    ) -> _KernelFn | None:
        """The kernel of this call's signature (``None``: the site's own code runs
        it), checked once per signature against the plan; every caller (stand-ins,
        the MHA route, the watch, attnres's transformers function) goes through it."""
        # is_dynamo_compiling, not is_compiling: the latter is a process-wide flag, true
        # in this thread's eager calls while another thread compiles (as modules.py)
        compiling = torch.compiler.is_dynamo_compiling()
        # issue 30: the mask's kind is in the signature, so a later call with another
        # kind is checked, never run on the kernel of the first
        mask: Any = False
        if attn_mask is not None:
            refuse_integer_mask(attn_mask)  # issue 32 item 1: every call, whatever runs it
            if compiling:
                mask = self.last_mask
                if mask is None and self.planned is not None:
                    mask = (self.planned.mask.kind, self.planned.mask.causal)
            else:
                mask = self.last_mask = mask_kind(q, k, attn_mask, heads_dim)
        # the layout of CallFacts.key, built with no object (it runs on every call,
        # and is traced whole by torch.compile); each ``.shape`` builds a torch.Size
        shape = q.shape
        head_size = shape[-1]
        key = (
            shape[heads_dim],
            k.shape[heads_dim],
            head_size,
            q.dtype,
            mask,
            bool(is_causal),
            scale is not None and _custom(scale, head_size),
            bool(dropout_p),
            weights,
            arguments,
        )
        if compiling:  # traced: no lock in a graph
            found = self.kernels.get(key, _UNSEEN)
        else:  # read under the lock _first_call writes under (issue 30: threads)
            with self._lock:
                found = self.kernels.get(key, _UNSEEN)
        if found is not _UNSEEN:
            kernel: _KernelFn | None = found
            return kernel
        if compiling:  # traced (not another thread): no mask values read, no record made
            raise CompiledGraphError(
                f"{self.where} met a call no decision covers inside torch.compile ({key[0]} "
                f"heads, {key[1]} kv heads, head size {head_size}, {q.dtype}"
                f"{', a mask' if attn_mask is not None else ''}"
                f"{', causal' if is_causal else ''}): run the applied model once with such "
                f"a call before compiling, so the site is decided outside the graph"
            )
        return self._first_call(
            CallFacts.observe(
                q,
                k,
                attn_mask,
                dropout_p,
                is_causal,
                scale,
                heads_dim,
                weights,
                arguments,
            )
        )

    def __deepcopy__(self, memo: dict[int, Any]) -> GenericRoute:
        """Issue 30: a deep copy of an applied model gets routes of its own: the same
        kernels and records so far, then its own first calls; its code is built
        again on the copy (:class:`_Installed`, :func:`_copy_processor`)."""
        new = object.__new__(GenericRoute)
        memo[id(self)] = new
        new.__dict__.update(self.__dict__)  # shared: spec, config, scope, platform
        with self._lock:
            new.kernels = dict(self.kernels)
            new.first_calls = list(self.first_calls)
            new.watched = dict(self.watched)
        new.homes, new._finalizer, new._lock, new.last_mask = [], None, threading.Lock(), None
        new._closed = []
        return new

    def __reduce_ex__(self, protocol: Any) -> Any:
        refuse_pickle(self.where)

    def close(self) -> None:
        """Forget the homes of its rebound functions (the route was removed); what
        they held is kept for :meth:`reopen`."""
        self._closed += [(home, key, home[key]) for home, key in self.homes if key in home]
        _forget_homes(self.homes)
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None

    def reopen(self, owner: Any) -> None:
        """Undo :meth:`close`, tied to ``owner`` again (:meth:`tie`): an apply that
        failed puts back the route it had set aside (its rebound functions read
        their stand-ins again); nothing where it is open."""
        for home, key, value in self._closed:
            home[key] = value
            self.homes.append((home, key))
        self._closed.clear()
        self.tie(owner)

    def tie(self, owner: Any) -> None:
        """Forget the homes of its rebound functions when ``owner`` (the module it is
        installed on) is collected: a model dropped without ``remove`` leaves no
        name in the library's namespaces (the homes never keep it alive)."""
        if self._finalizer is None:
            self._finalizer = weakref.finalize(owner, _forget_homes, self.homes)

    def dispatcher(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """In place of diffusers' ``dispatch_attention_fn`` (batch, seq, heads, dim):
        the decided kernel, or ``original`` itself where the decision is SDPA."""

        def dispatch(
            query: Any,
            key: Any,
            value: Any,
            attn_mask: Any = None,
            dropout_p: float = 0.0,
            is_causal: bool = False,
            scale: float | None = None,
            *args: Any,
            **rest: Any,
        ) -> Any:
            mask = dispatcher_mask(attn_mask, query, key)
            kernel = self.kernel_for(query, key, mask, dropout_p, is_causal, scale, -2)
            if kernel is None:  # diffusers' own backend reads the mask in its own forms
                if self.dispatch_sdpa is not None:
                    rest["backend"] = self.dispatch_sdpa
                return original(
                    query, key, value, attn_mask, dropout_p, is_causal, scale, *args, **rest
                )
            return kernel(query, key, value, dense_mask(mask, query, key, -3), is_causal, scale)

        return dispatch

    def _first_call(self, facts: CallFacts) -> _KernelFn | None:
        with self._lock:
            if facts.key() in self.kernels:
                return self.kernels[facts.key()]
            changed = facts.differences(self.planned)
            if not changed and self.planned is not None and self.planned.key() in self.kernels:
                # a call the plan allowed (it brings less than planned): the planned kernel
                kernel = self.kernels[self.planned.key()]
                self.kernels[facts.key()] = kernel
                return kernel
            spec = facts.spec(self.spec, self.name, self.own)
            if self.spec is None:  # decided at its first call
                if self.keeps_own and spec.preferred is None:
                    spec = attrs.evolve(spec, preferred=frozenset({self.own}))
                if self.own_route is not None and spec.supported is None:
                    # a route that runs only its own code
                    own_only = frozenset({self.own})
                    spec = attrs.evolve(spec, supported=own_only, exact_route=self.own_route)
                if self.config.backend_options:  # issue 23: it takes the config's options
                    spec = attrs.evolve(spec, backend_options=self.config.backend_options)
            resolution, _, trace = lookup(
                spec, self.config, self.scope, self.platform, None, needs_kernel=True
            )
            backend = None if resolution is None else resolution.backend
            error = None
            if resolution is None:
                error = (
                    f"{self.where}: observed at first call: {', '.join(changed)}, which its "
                    f"plan did not allow; {trace.outcome.error}"
                )
                if spec.exact_route is not None and spec.exact_route not in error:
                    error += f" (the site's route: {spec.exact_route})"  # as a plan says it
            record = FirstCall(self.component, self.name, facts, changed, trace, backend, error)
            self.first_calls.append(record)
            if resolution is None:
                raise ResolutionError(str(error), trace, str(trace.outcome.code))
            own = _EAGER if facts.weights or facts.arguments else self.own
            kernel = self._kernel(resolution.backend, spec, own)
            self.kernels[facts.key()] = kernel
            return kernel


def site_route(
    site: Site,
    config: SelectionConfig,
    platform: Platform,
    own: Backend | None = None,
    own_route: str | None = None,
) -> GenericRoute:
    """The route of one planned site (every integration builds its routes here);
    ``own``: what the site's own code runs (default: the site's current backend);
    ``own_route``: a site decided at its first call whose route runs only that."""
    return GenericRoute(
        component=site.component,
        name=site.name,
        spec=site.spec,
        heads=site.heads,
        kv_heads=site.kv_heads,
        resolution=site.resolution,
        config=config,
        scope=scope_state(site.component),
        platform=platform,
        own=own or site.current,
        own_route=own_route,
    )


def unflagged(config: SelectionConfig, component: str) -> bool:
    """Whether no flag names a backend for ``component`` (no global or forced
    backend, no override for it): a site of its own code decided at its first
    call would decide its own code then, so nothing is wrapped (issue 30)."""
    named = any(name == component for name, _ in config.component_backends)
    return not (config.global_backend or config.forced_backend or named)


def refuse_pickle(what: str) -> NoReturn:
    """Issue 30: pickle and ``torch.save`` of a model with routes installed are
    refused, typed, naming ``remove()`` (a route is code of this process)."""
    raise AppliedModelPickleError(
        f"cannot pickle a model with attnres's routes installed ({what}): a route is code "
        f"installed in this process, which a file cannot carry. Call the integration's "
        f"remove() on the model first (attnres.integrations.diffusers.remove or "
        f"attnres.integrations.transformers.remove), save it, and apply again after "
        f"loading; copy.deepcopy of an applied model works"
    )


def _forget_homes(homes: list[tuple[dict[str, Any], str]]) -> None:
    for namespace, key in homes:
        namespace.pop(key, None)
    homes.clear()


_ROUTE_ATTR = "_attnres_route"
_FUNCTIONAL = torch.nn.functional
#: the attribute a module's code reaches SDPA through from each torch module
#: (``torch.nn.functional.scaled_dot_product_attention``, ``nn.functional....``)
_INNER = ((torch, "nn"), (torch.nn, "functional"))


def _stand_in(value: Any, names: set[str], route: GenericRoute | None) -> Any:
    """What a global holding ``torch``, ``torch.nn`` or ``torch.nn.functional``
    becomes in a routed copy (``None``: itself): a module of the same names whose
    path to SDPA is the route's. Only the modules the code's ``names`` lead
    through are stood in."""
    subs: dict[str, Any] = {}
    if value is _FUNCTIONAL:
        if SDPA not in names:
            return None
        subs[SDPA] = route
    inner = next((attr for held, attr in _INNER if value is held), None)
    if inner is not None and inner in names:
        nested = _stand_in(getattr(value, inner), names, route)
        if nested is not None:
            subs[inner] = nested
    if not subs or route is None:  # nothing to stand in, or a dry run (:func:`rebind`)
        return subs or None
    shim = types.ModuleType(value.__name__)
    shim.__dict__.update(value.__dict__)
    shim.__dict__.update(subs)
    return shim


def rebind(func: Any, route: GenericRoute | None, depth: int = 2) -> Any:
    """A copy of ``func`` whose attention calls go to ``route``, or ``None`` when its
    code (and the module-level functions it calls, ``depth`` levels) names none,
    or names one otherwise than as a global. ``route=None``: a dry run, which
    changes nothing and answers ``func`` where a copy can be made.

    Each global holding ``torch.nn.functional`` (or ``torch``, ``torch.nn`` on the
    way), ``scaled_dot_product_attention`` or ``dispatch_attention_fn`` is read
    under a name of the route's own, added to the function's module namespace and
    holding its stand-in (:func:`_stand_in`, the route, ``route.dispatcher``).
    Every other global is read live (issue 30: one reassigned after ``apply`` is
    seen). The added names go with the route (:meth:`GenericRoute.close`, or
    when the module is collected).
    """
    func = getattr(func, "__func__", func)
    code = getattr(func, "__code__", None)
    if not isinstance(func, types.FunctionType) or not isinstance(code, types.CodeType):
        return None
    names = {name for c in _codes(code) for name in c.co_names}
    glob = func.__globals__
    subs: dict[str, Any] = {}
    # only what the code loads as a global is stood in: a name it also reads as an
    # attribute on the way (``torch.nn.functional``) stays as it is
    loaded, used_otherwise = _name_uses(code)
    for name in loaded:
        value = glob.get(name)
        shim = _stand_in(value, names, route)
        if shim is not None:
            subs[name] = shim
        elif value is _SDPA:
            subs[name] = route
        elif name == DISPATCHER and callable(value):
            subs[name] = value if route is None else route.dispatcher(value)
        elif isinstance(value, types.FunctionType) and depth > 0 and value is not func:
            inner = rebind(value, route, depth - 1)
            if inner is not None:
                subs[name] = inner
    if not subs or used_otherwise & subs.keys():
        return None  # a name also used otherwise (an attribute) cannot be renamed
    if route is None:
        return func
    # a key per copy: two functions of one module may need different stand-ins
    # for one name (the chains their code names)
    tag = f"_attnres_route_{id(route):x}_{len(route.homes)}"
    keys = {name: f"{tag}_{name}" for name in subs}
    for name, key in keys.items():
        glob[key] = subs[name]
        route.homes.append((glob, key))
    copy_ = types.FunctionType(
        _renamed(code, keys), glob, func.__name__, func.__defaults__, func.__closure__
    )
    copy_.__kwdefaults__ = func.__kwdefaults__
    copy_.__dict__.update(func.__dict__)
    copy_.__qualname__ = func.__qualname__
    copy_.__doc__ = func.__doc__
    return copy_


@functools.lru_cache(maxsize=1024)
def _name_uses(code: types.CodeType) -> tuple[frozenset[str], frozenset[str]]:
    """The names ``code`` (and the code it holds) loads as globals, and those it
    uses otherwise (as an attribute, say): one walk of its instructions (a
    code object never changes: remembered, as :func:`_parse_code`)."""
    loaded: set[str] = set()
    otherwise: set[str] = set()
    for c in _codes(code):
        for ins in dis.get_instructions(c):
            if ins.opcode in dis.hasname:
                (loaded if ins.opname == "LOAD_GLOBAL" else otherwise).add(ins.argval)
    return frozenset(loaded), frozenset(otherwise)


def _renamed(code: types.CodeType, keys: dict[str, str]) -> types.CodeType:
    return code.replace(
        co_names=tuple(keys.get(n, n) for n in code.co_names),
        co_consts=tuple(
            _renamed(c, keys) if isinstance(c, types.CodeType) else c for c in code.co_consts
        ),
    )


#: the calls a route takes (:func:`rebind` stands in the globals leading to them)
_ROUTABLE = frozenset({SDPA, DISPATCHER})


def reroutes(obj: Any) -> dict[str, Any] | str:
    """Issue 30, one install mechanism: where a route installs on ``obj`` (a module,
    or a processor), as ``{attribute: function}``: each method of its own classes
    that its entry (``forward``, ``__call__``) reaches through ``self`` and whose
    code names SDPA or the dispatcher, copied there by :func:`rebind`, under the
    attribute the instance reaches it by (its own name; where the instance holds
    another callable under it, as accelerate's hooks hold ``forward``, the
    attribute holding the method bound to it, as their ``_old_forward``). A
    string: why no copy can take its attention calls (observed, nothing changed)."""
    cls = type(obj)
    if _FOUND_ATTR in vars(cls):  # a processor routed already: read as its own class
        cls = cls.__bases__[0]
    entry = "forward" if isinstance(obj, torch.nn.Module) else "__call__"
    methods = methods_of(cls)
    found: dict[str, Any] = {}
    todo, seen = [entry], set()
    while todo:  # the methods the entry reaches, by the names their code holds
        name = todo.pop()
        func = methods.get(name)
        if func is None or name in seen:
            continue
        seen.add(name)
        if calls_of([func]) & _ROUTABLE:
            if rebind(func, None) is None:
                return (
                    f"{func.__qualname__} reaches it through no global name (an attribute, "
                    f"a decorator)"
                )
            found[name] = func
        todo += [n for c in _codes(func.__code__) for n in c.co_names]
    if not found:
        return (
            f"{cls.__name__}.{entry} reaches it through no method of its own (an "
            f"attribute holding SDPA)"
        )
    if entry == "__call__":  # a processor: its routed class holds the copies
        shadowed = found.keys() & getattr(obj, "__dict__", {}).keys()
        return found if not shadowed else f"the instance holds its own {min(shadowed)}"
    view = _view(obj)
    out: dict[str, Any] = {}
    for name, func in found.items():
        attr = _attribute(obj, view, name, func)
        if attr is None:
            return (
                f"the instance holds a {name} of its own (a hook's, say) and no "
                f"{cls.__name__}.{name} bound to it that it calls"
            )
        out[attr] = func
    return out


def _view(obj: Any) -> dict[str, Any]:
    """``obj``'s attributes as before any route of attnres's (an installed function
    read as what it replaced)."""
    return {
        k: v.original() if isinstance(v, _Installed) and v.module is obj else v
        for k, v in vars(obj).items()
    }


def _attribute(obj: Any, view: dict[str, Any], name: str, func: Any) -> str | None:
    """The attribute ``obj`` reaches its class's method ``func`` (``name``) by: its
    name, unless the instance holds another callable there (accelerate's hooks
    hold ``forward``); then the one holding ``func`` bound to ``obj`` (their
    ``_old_forward``). ``None``: none does."""
    if view.get(name) is None:
        return name
    bound = (k for k, v in view.items() if getattr(v, "__func__", None) is func)
    return next((k for k in bound if getattr(view[k], "__self__", None) is obj), None)


def names_of(obj: Any, depth: int = 2, skip: frozenset[type] = frozenset()) -> frozenset[str]:
    """What the code of ``obj``'s own classes names (:func:`methods_of` with
    ``skip``, :func:`calls_of` ``depth`` levels down), with SDPA where ``obj`` or
    its own classes hold SDPA itself as an attribute (``attend =
    staticmethod(F.scaled_dot_product_attention)``): a call through it names no
    SDPA, yet the site is one (issue 30), which no copy can take."""
    names = calls_of(methods_of(obj, skip).values(), depth)
    if SDPA in names:
        return names
    own = [v for k in type(obj).__mro__ if not _torchs(k) for v in vars(k).values()]
    held = [*getattr(obj, "__dict__", {}).values(), *own]
    return names | {SDPA} if any(getattr(v, "__func__", v) is _SDPA for v in held) else names


def routed_processor(processor: Any, route: GenericRoute) -> Any:
    """A copy of ``processor`` whose attention calls go to ``route`` (its methods
    :func:`reroutes` names, copied); ``None``: it has none a copy can take."""
    found = reroutes(processor)
    if isinstance(found, str):
        return None
    routed = copy.copy(processor)
    routed.__class__ = _routed_class(type(processor), route, found)
    return routed


#: the routed class's record of the methods it copied (:func:`_copy_processor`)
_FOUND_ATTR = "_attnres_reroutes"


def _routed_class(cls: type, route: GenericRoute, found: dict[str, Any]) -> type:
    return type(
        cls.__name__,
        (cls,),
        {
            **{name: rebind(func, route) for name, func in found.items()},
            "__module__": cls.__module__,
            "__deepcopy__": _copy_processor,
            "__reduce_ex__": _refuse_processor,
            _ROUTE_ATTR: route,
            _FOUND_ATTR: found,
        },
    )


def _copy_processor(self: Any, memo: dict[int, Any]) -> Any:
    """A routed processor's deep copy (issue 30): its state copied, its call routed
    again to the copy's own route (the deep copy of its route)."""
    routed = type(self)
    route = copy.deepcopy(routed.__dict__[_ROUTE_ATTR], memo)
    found = routed.__dict__[_FOUND_ATTR]
    new: Any = object.__new__(_routed_class(routed.__bases__[0], route, found))
    memo[id(self)] = new
    new.__dict__.update(copy.deepcopy(self.__dict__, memo))
    route.tie(new)
    return new


def _refuse_processor(self: Any, protocol: Any) -> Any:
    refuse_pickle(f"a routed {type(self).__name__}")


def _rebound(func: Any, module: Any, route: GenericRoute, original: Any) -> Any:
    """A build of :class:`_Installed`: ``func`` copied (:func:`rebind`), bound to
    ``module`` (``original``, what the attribute held, is not called)."""
    return types.MethodType(rebind(func, route), module)


class _Installed(functools.partial[Any]):
    """What :func:`install_route` sets on the instance under ``attr``:
    ``build(module, route, original)``, called, where ``original`` is what the
    instance reached there before (:meth:`original`). A ``functools.partial`` of
    it, so that a call reaches the built function from C with its arguments as
    given (a ``__call__`` written in Python repacks them on every call, ``make
    bench``). Issue 30: a deep copy of the module builds its own at its first
    call (a closure over the original would run the original's weights);
    pickling is refused, typed (:func:`refuse_pickle`)."""

    module: Any
    route: GenericRoute
    build: Any
    attr: str
    previous: Any
    lock: threading.Lock

    def __new__(
        cls, module: Any, route: GenericRoute, build: Any, attr: str, previous: Any
    ) -> _Installed:
        self = super().__new__(cls, _unbuilt)
        self.module, self.route, self.build = module, route, build
        self.attr, self.previous, self.lock = attr, previous, threading.Lock()
        self._point(build(module, route, self.original()))
        return self

    def original(self) -> Any:
        """What the instance reached under ``attr`` before: the value it held
        there, else its class's method bound to it."""
        if self.previous is not None:
            return self.previous
        return types.MethodType(getattr(type(self.module), self.attr), self.module)

    def _first_call(self, *args: Any, **kwargs: Any) -> Any:
        """What a deep copy calls until it is built: it builds it, as at install,
        and calls it from then on."""
        with self.lock:
            if self.func == self._first_call:  # not built yet (another thread may have)
                self._point(self.build(self.module, self.route, self.original()))
        return self.func(*args, **kwargs)

    def _point(self, fn: Any) -> None:
        """Calls reach ``fn`` from now on (the partial's state: its function, no
        argument bound, its attributes kept)."""
        self.__setstate__((fn, (), None, self.__dict__))  # type: ignore[attr-defined]

    def __deepcopy__(self, memo: dict[int, Any]) -> _Installed:
        new = functools.partial.__new__(_Installed, _unbuilt)
        memo[id(self)] = new
        new.module = copy.deepcopy(self.module, memo)  # the copy (already in memo)
        new.route = copy.deepcopy(self.route, memo)
        new.build, new.attr, new.lock = self.build, self.attr, threading.Lock()
        new.previous = copy.deepcopy(self.previous, memo)
        new.route.tie(new.module)
        new._point(new._first_call)
        return new

    def __reduce_ex__(self, protocol: Any) -> Any:
        refuse_pickle(self.route.where)


def _unbuilt(*args: Any, **kwargs: Any) -> NoReturn:
    """An installed function's target for the moment it is made (:meth:`_Installed._point`)."""
    raise InvalidStateError("an installed route's function was called before it was set")


def install_route(module: Any, route: GenericRoute, build: Any = None) -> None:
    """Send ``module``'s attention calls to ``route`` (this module only).

    ``build``, when given, makes the site's forward from the module, the route
    and the forward it replaces (:func:`mha_forward`, :func:`watch_forward`).
    Otherwise the methods :func:`reroutes` finds are copied (:func:`rebind`) onto
    the instance, under the attributes it reaches them by; a module whose calls
    no copy can take was planned as a pin (it runs its own code), so this raises
    :class:`~attnres.errors.InvalidStateError` there. Issue 30: built again for a
    deep copy (:class:`_Installed`)."""
    remove_route(module)
    if build is not None:
        # accelerate's hooks hold a forward of their own and call the one they
        # wrap as ``_old_forward``: the build goes there, inside the hook
        at = _attribute(module, _view(module), "forward", type(module).forward)
        builds = {at or "forward": build}
    else:
        found = reroutes(module)
        if isinstance(found, str):
            raise InvalidStateError(
                f"{route.where}: {found}; its plan said otherwise, so the module changed "
                f"after planning: plan and apply again"
            )
        builds = {attr: functools.partial(_rebound, func) for attr, func in found.items()}
    held = []
    for attr, make in builds.items():
        previous = module.__dict__.get(attr)
        installed = _Installed(module, route, make, attr, previous)
        module.__dict__[attr] = installed
        held.append((attr, previous, installed))
    module.__dict__[_ROUTE_ATTR] = (route, held)


def installed_route(module: Any) -> GenericRoute | None:
    held = module.__dict__.get(_ROUTE_ATTR)
    return held[0] if isinstance(held, tuple) else None


#: what :func:`install_route` set on a module: its route, and per attribute what
#: the attribute held before and what was set there
Held = tuple[GenericRoute, list[tuple[str, Any, _Installed]]]


def remove_route(module: Any) -> Held | None:
    """Undo :func:`install_route`; what it removed (``None``: there was none), which
    :func:`restore_route` puts back."""
    held: Held | None = module.__dict__.pop(_ROUTE_ATTR, None)
    if held is None:
        return None
    route, installs = held
    route.close()
    for attr, previous, installed in installs:
        if module.__dict__.get(attr) is not installed:
            # wrapped after install (accelerate's hooks, added after apply, call it
            # as the forward they wrap): the wrapper stays, and it now reaches what
            # it reached before install
            installed._point(installed.original())
        elif previous is None:
            module.__dict__.pop(attr, None)
        else:
            module.__dict__[attr] = previous
    return held


def restore_route(module: Any, held: Held) -> None:
    """Put back on ``module`` the route :func:`remove_route` removed from it (an apply
    that set it aside failed): the very functions it had, its kernels and records."""
    route, installs = held
    route.reopen(module)
    for attr, previous, installed in installs:
        if module.__dict__.get(attr) is not previous:
            # wrapped after install: the wrapper reaches the route's build again
            installed._point(installed.build(module, route, installed.original()))
        else:
            module.__dict__[attr] = installed
    module.__dict__[_ROUTE_ATTR] = held


# =============================================================================
# Own code paths: torch.nn.MultiheadAttention, a site decided at its first call
# =============================================================================


def _additive(mask: Any, dtype: Any) -> Any:
    if mask.dtype != torch.bool:
        return mask.to(dtype)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
        ~mask, float("-inf")
    )


def _mha_mask(
    attn_mask: Any, padding: Any, batch: int, heads: int, seq_q: int, seq_kv: int, dtype: Any
) -> Any:
    """``nn.MultiheadAttention``'s masks (boolean: True may *not* attend; float:
    added) as one mask of SDPA semantics, broadcastable to (batch, heads, seq_q,
    seq_kv): a ``key_padding_mask`` alone is a (batch, 1, 1, seq_kv) key-padding mask.
    At least one of the two is given."""
    masks = []
    if attn_mask is not None:
        m = attn_mask if attn_mask.dim() == 2 else attn_mask.view(batch, heads, seq_q, seq_kv)
        masks.append(~m if m.dtype == torch.bool else m)
    if padding is not None:
        m = padding.view(batch, 1, 1, seq_kv)
        masks.append(~m if m.dtype == torch.bool else m)
    if len(masks) == 1:
        return masks[0]
    a, b = masks
    if a.dtype == torch.bool and b.dtype == torch.bool:
        return a & b
    return _additive(a, dtype) + _additive(b, dtype)


def _mha_projections(module: Any, query: Any, key: Any, value: Any) -> tuple[Any, Any, Any]:
    """The in-projections of ``nn.MultiheadAttention`` (torch 2.x ``_in_projection``)."""
    linear = torch.nn.functional.linear
    embed = module.embed_dim
    bias = module.in_proj_bias
    bq, bk, bv = (None, None, None) if bias is None else bias.split(embed)
    if module._qkv_same_embed_dim:
        wq, wk, wv = module.in_proj_weight.split(embed)
    else:
        wq, wk, wv = module.q_proj_weight, module.k_proj_weight, module.v_proj_weight
    return linear(query, wq, bq), linear(key, wk, bk), linear(value, wv, bv)


class _Watch(TorchFunctionMode):
    """Check one forward of a site decided at its first call, before its attention
    output is computed: its first SDPA call, or its first softmax of a product of
    two batched tensors (the scores: query ``(..., seq_q, head size)`` times key
    ``(..., head size, seq_kv)``, the last product before it), is handed to the
    route, which binds the site (or raises, typed); nothing else is run.

    Issue 30: only the site's own code's calls count. A mode sees every call made
    while it is active, a nested module's too (an attention module the site
    holds): its facts (heads, head size, mask) are not the site's, and it is
    passed by untouched. Which code made a call is read from the frames between
    it and the watched forward's (``home``): one of ``nn.Module.__call__``, or a
    ``forward`` run directly, whose module is neither the site nor its processor
    makes it a nested module's. The rest is the site's own code, as
    :func:`rebind` copies it: its methods, the functions they call
    (transformers' ``eager_attention_forward(module, ...)``), its processor
    (an ``nn.Module`` in a few diffusers classes), and torch's own frames
    between (``Tensor.__matmul__``, ``F.softmax``), which are no module's. The
    walk runs only for an SDPA call, a softmax or a batched product met before
    the site's call (``make bench``), and reads the locals of module frames
    only. The scores are the last product the site's own code made, else the
    last a nested module made (a product computed by a module the site calls,
    SqueezeBERT's ``MatMulWrapper``); the softmax is always the site's own.

    A forward torch.compile traces has no frames (``home`` is ``None``): there a
    call is passed by where eager forwards met its facts only in nested modules
    (:attr:`GenericRoute.watched`), and the scores are the last product."""

    def __init__(self, route: GenericRoute, site: Any, home: types.FrameType | None) -> None:
        super().__init__()
        self.route = route
        self.site = site
        self.home = home
        self.seen = False
        #: the last product of two batched tensors the site's own code made, and
        #: the last any code made (a traced forward reads only the latter)
        self.scores: tuple[Any, Any] | None = None
        self.last: tuple[Any, Any] | None = None

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.seen:
            return func(*args, **kwargs)
        if func is _SDPA:
            q, k = args[0] if args else kwargs["query"], args[1] if len(args) > 1 else kwargs["key"]
            mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
            if self._takes(q, k, mask is not None, self.home is None or not self._nested()):
                self.seen = True
                dropout = args[4] if len(args) > 4 else kwargs.get("dropout_p", 0.0)
                causal = args[5] if len(args) > 5 else kwargs.get("is_causal", False)
                self._check(q, k, mask, dropout, causal, kwargs.get("scale"))
        elif func in _SOFTMAXES and self.last is not None:
            own = self.home is None or not self._nested()
            a, b = (self.scores or self.last) if own else self.last
            q, k = a, b.transpose(-1, -2)
            if a.dim() == 3:  # (batch, seq, size): one head per batch row
                q, k = q.unsqueeze(-3), k.unsqueeze(-3)
            if self._takes(q, k, False, own):
                self.seen = True
                self._check(q, k, None, 0.0, False, None)
        elif func in _MATMULS and len(args) >= 2:
            a, b = args[0], args[1]
            if (
                isinstance(a, torch.Tensor)
                and isinstance(b, torch.Tensor)
                and a.dim() in (3, 4)
                and b.dim() == a.dim()
                and a.shape[-1] == b.shape[-2]
            ):
                self.last = (a, b)
                if self.home is not None and not self._nested():
                    self.scores = (a, b)
        return func(*args, **kwargs)

    def _nested(self) -> bool:
        """Whether the call being handled is not the site's own code's: walking out
        from it, a module is called (or another module's ``forward`` runs) before
        the watched forward's frame is reached."""
        home = self.home
        frame: types.FrameType | None = sys._getframe(2)  # the caller of __torch_function__
        while frame is not home:
            if frame is None:  # made outside the watched forward: not the site's
                return True
            back = frame.f_back
            code = frame.f_code
            # the frame the watch called (the watched forward) is the site's: its
            # locals are never read
            if (code in _MODULE_CALLS or code.co_name == "forward") and back is not home:
                first = frame.f_locals.get(code.co_varnames[0]) if code.co_argcount else None
                if self._other(first):
                    return True
            frame = back
        return False

    def _other(self, obj: Any) -> bool:
        """Whether ``obj`` (a frame's first argument) is a module other than the
        site and its processor (the site's own code, however it is called)."""
        if obj is self.site or not isinstance(obj, torch.nn.Module):
            return False
        return obj is not getattr(self.site, "processor", None)

    def _takes(self, q: Any, k: Any, masked: bool, own: bool) -> bool:
        """Whether this call (``own``: made by the site's own code, as far as the
        frames tell) is the site's; what eager forwards met is kept for a traced
        one (:attr:`GenericRoute.watched`)."""
        heads = q.shape[-3] if q.dim() > 3 else 1
        facts = (heads, k.shape[-3] if k.dim() > 3 else 1, q.shape[-1], q.dtype, masked)
        watched = self.route.watched
        if self.home is None:  # traced: passed by if only nested modules made it
            return watched.get(facts) is not False
        if own:
            watched[facts] = True
        else:
            watched.setdefault(facts, False)
        return own

    def _check(
        self, q: Any, k: Any, mask: Any, dropout: float, causal: bool, scale: float | None
    ) -> None:
        if self.route.kernel_for(q, k, mask, dropout, causal, scale, -3) is not None:
            raise InvalidStateError(
                f"attention site {self.route.name!r} runs only its own code "
                f"({self.route.own.name}), yet its route chose a kernel for this call; "
                f"plan and apply the model again"
            )


def watch_forward(module: Any, route: GenericRoute, original: Any = None) -> Callable[..., Any]:
    """``module``'s forward (``original``, default its ``forward``) for a site
    decided at its first call whose route runs only its own code (softmax by
    hand, or the attention function its config names): each call's facts are
    read (:class:`_Watch`, from this frame's calls only, never a nested
    module's) and checked by ``route``; the computation is the module's own,
    untouched."""
    original = original or module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        # the frame is the watch's to walk out to (dynamo traces none); held by
        # the watch only, never by a local here (a frame holding itself would
        # keep the call's tensors until a collection)
        compiling = torch.compiler.is_dynamo_compiling()
        with _Watch(route, module, None if compiling else sys._getframe()):
            return original(*args, **kwargs)

    return forward


def mha_forward(module: Any, route: GenericRoute, original: Any = None) -> Callable[..., Any]:
    """``nn.MultiheadAttention.forward`` for one site: its own math (in-projection,
    heads split, attention, out-projection) with the attention the decided kernel.

    Each call's facts are checked (:meth:`GenericRoute.kernel_for`): its mask
    (``attn_mask`` and/or ``key_padding_mask``), causal (``is_causal`` with no
    padding mask, as torch reads it), dropout (training only) and
    ``need_weights=True``, which no kernel serves. A signature decided what the
    module runs itself calls its own ``forward`` (``original``, default its
    ``forward``) with the call's arguments.
    """
    original = original or module.forward
    batch_first = bool(module.batch_first)
    heads = int(module.num_heads)
    size = int(module.head_dim)
    at = 0 if batch_first else 1  # an unbatched call's batch dimension, added

    def routed(
        query: Any,
        key: Any,
        value: Any,
        padding: Any,
        need_weights: bool,
        attn_mask: Any,
        is_causal: bool,
    ) -> Any:
        """The call on the decided kernel, or ``None`` where the module's own path runs it."""
        if is_causal and attn_mask is None:  # torch says what is wrong with the call
            return None
        batched = query.dim() == 3
        q_in, k_in, v_in = query, key, value
        if not batched:
            q_in, k_in, v_in = q_in.unsqueeze(at), k_in.unsqueeze(at), v_in.unsqueeze(at)
            padding = None if padding is None else padding.unsqueeze(0)
        if not batch_first:
            q_in, k_in, v_in = q_in.transpose(0, 1), k_in.transpose(0, 1), v_in.transpose(0, 1)
        shape = q_in.shape
        n, seq_q = shape[0], shape[1]
        seq_kv = k_in.shape[1]
        dropout_p = module.dropout if module.training else 0.0
        causal = bool(is_causal) and padding is None and not need_weights
        if need_weights and attn_mask is None and padding is None:
            # only the module's own path returns the weights: a signature already
            # decided is known before projecting (its key from the call's scalars),
            # so the own path never pays the projections twice (a masked call's key
            # holds its mask's kind: read from the mask below)
            dtype = _dtype_name(query.dtype)
            seen = CallFacts(
                heads, heads, size, dtype, MaskFacts(False), False, False, bool(dropout_p), True
            )
            if route.kernels.get(seen.key(), _UNSEEN) is None:
                return None
        q, k, v = _mha_projections(module, q_in, k_in, v_in)
        mask = None
        if not causal and (attn_mask is not None or padding is not None):
            mask = _mha_mask(attn_mask, padding, n, heads, seq_q, seq_kv, q.dtype)
        q = q.view(n, seq_q, heads, size)
        k = k.view(n, seq_kv, heads, size)
        v = v.view(n, seq_kv, heads, size)
        kernel = route.kernel_for(q, k, mask, dropout_p, causal, None, -2, bool(need_weights))
        if kernel is None:
            return None
        if need_weights:
            raise AssertionError("a call that returns its weights runs its own path only")
        out = kernel(q, k, v, mask, causal, None).reshape(n, seq_q, heads * size)
        out = torch.nn.functional.linear(out, module.out_proj.weight, module.out_proj.bias)
        if not batch_first:
            out = out.transpose(0, 1)
        if not batched:
            out = out.squeeze(at)
        return out, None

    # the call's arguments pass on as values (a closure over them would build its
    # cells on every call)
    def forward(
        query: Any,
        key: Any,
        value: Any,
        key_padding_mask: Any = None,
        need_weights: bool = True,
        attn_mask: Any = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> Any:
        out = routed(query, key, value, key_padding_mask, need_weights, attn_mask, is_causal)
        if out is not None:
            return out
        return original(
            query,
            key,
            value,
            key_padding_mask=key_padding_mask,
            need_weights=need_weights,
            attn_mask=attn_mask,
            average_attn_weights=average_attn_weights,
            is_causal=is_causal,
        )

    return forward
