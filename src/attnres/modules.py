"""``attnres.Attention``: a ``torch.nn.Module`` that runs the resolved kernel.

The layer resolves once, at construction, inside the current component scope
(:func:`attnres.resolve` with the layer's :class:`~attnres.LayerSpec`; the
scope's role override reaches the resolver through the spec's role), and binds
the kernel then. ``forward`` makes no decision, looks nothing up and builds no
dicts: it checks the input shapes and dtype against the layer with a handful of
integer comparisons and calls the bound kernel.

One binding per layer: what a layer runs is one immutable ``_Bound`` (the
resolution, the kernel, the forward body), and :meth:`Attention._compose` is
the one writer of the forward: it wraps the binding in the policies that apply
(late binding while pending, the training guard, autotune's measuring wrapper,
the per-request switch of :func:`attnres.request_backend`, which reads the
caller's context only on layers a request switched once).

Errors
------
- construction: a bad argument is a ``ValueError`` naming it; a rejected
  resolution is :class:`~attnres.ResolutionError` (a ``ValueError``);
- construction: the selected backend has no kernel adapter (a sparse backend, or
  a third-party backend registered without a kernel) is
  :class:`KernelNotRegisteredError`, a ``RuntimeError``: the arguments are fine
  (the same call works once a kernel is registered), the process lacks an
  implementation. Its message says how to register one;
- construction: the selected backend's kernel package cannot be imported (the
  platform facts said it could) is
  :class:`~attnres.kernels.KernelUnavailableError`, an ``ImportError``;
- ``forward``: inputs that do not match the layer (rank, batch, heads, head
  size, k/v shapes, a dtype the kernel cannot take, q/k/v dtypes that differ)
  are a ``ValueError`` saying which.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import numbers
import operator
import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import Any, Final, NamedTuple, overload

import attrs
import torch
from torch import Tensor, nn

from attnres._fastcall import FastCallModule
from attnres._memo import GenerationMemo
from attnres._varlen import check_layer_options, refuse_integer_mask, route_kernel
from attnres._vocab import Role, normalize_dtype
from attnres.audit import emit_cache_hit
from attnres.autotuner import arm, armed_run
from attnres.backends import (
    Backend,
    BackendOptions,
    lookup_spec,
    merge_backend_options,
    normalize_backend_options,
    registry_generation,
)
from attnres.errors import (
    ArgumentTypeError,
    BackendNotAppliedError,
    CompiledGraphError,
    InvalidArgumentError,
    InvalidStateError,
    KernelNotRegisteredError,
)
from attnres.kernels import KernelFn, KernelUnavailableError, get_kernel, specialized
from attnres.layer import LayerSpec, Requirements, SelectionConfig, optional_backend
from attnres.ledger import Decision, record_decision, replace_decision
from attnres.machine import backward_everywhere, has_backward_pass, training_spec
from attnres.parallel import SequenceParallel
from attnres.platform import Platform, detected_platform
from attnres.runtime import (
    Resolution,
    bind_pending,
    cache_epoch,
    capture_config,
    lookup,
    rejection,
)
from attnres.scope import ScopeHandle, ScopeState, current_handle

__all__ = ["Attention", "KernelNotRegisteredError", "bind"]


_TORCH_DTYPES: Final[dict[str, torch.dtype]] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}

# Memos for the construction path (a 48-block model builds the same layer 48
# times). They map hashable, immutable inputs to immutable outputs, but what an
# input means depends on the registry (a backend alias that moves to another
# backend, a kernel replaced for a name): every memo belongs to one registry
# generation (attnres._memo: it reads empty after any registry change,
# including kernel (un)registration and ``clear_kernel_cache``). They are
# bounded: the oldest eighth goes when one is full.
_MEMO_MAX: Final = 1024
_MEMO_LOCK = threading.Lock()
_SPECS: GenerationMemo[tuple[object, ...], LayerSpec] = GenerationMemo(_MEMO_MAX)
_DTYPE_SETS: GenerationMemo[frozenset[str], frozenset[torch.dtype]] = GenerationMemo(_MEMO_MAX)
#: (shape, kernel, dtypes) -> the forward closure of :func:`_make_run`
_RUNS: GenerationMemo[tuple[object, ...], Callable[..., Tensor]] = GenerationMemo(_MEMO_MAX)
#: (backend, requirements, role, platform) -> whether the kernel has a backward pass
_HAS_BACKWARD: GenerationMemo[tuple[object, ...], bool] = GenerationMemo(_MEMO_MAX)
#: (id of lookup's cache entry, the layer's shape) -> (that entry, the binding):
#: a layer built again (a second model) binds with a dict read
_BINDINGS: GenerationMemo[tuple[int, _LayerShape], tuple[object, _Bound]] = GenerationMemo(
    _MEMO_MAX
)
#: id of a binding's resolution -> (that resolution, the spec, whether _guard wraps it)
_GUARDED: GenerationMemo[int, tuple[Resolution, LayerSpec, bool]] = GenerationMemo(_MEMO_MAX)
#: a construction's arguments (checked), config, scope, platform and the resolution
#: cache's epoch -> (the spec, the parsed backend=, lookup's cache entry, the
#: binding): the same layer built again (48 blocks of a model, a second model)
#: records that entry's decision and runs that binding without looking it up. The
#: epoch (attnres.runtime.cache_epoch) keeps it to entries still in the resolution
#: cache: after clear_cache() or an eviction a layer resolves again, as lookup would
_BUILT: GenerationMemo[tuple[object, ...], tuple[LayerSpec, Backend | None, Any, _Bound]] = (
    GenerationMemo(_MEMO_MAX)
)
#: backend name -> (kernel, torch dtypes) of :func:`_bind`, once it succeeded
_BOUND: GenerationMemo[tuple[str, Any, Any], tuple[KernelFn, frozenset[torch.dtype]]] = (
    GenerationMemo(_MEMO_MAX)
)


def _memo_put(memo: GenerationMemo[Any, Any], key: object, value: object) -> None:
    with _MEMO_LOCK:
        memo.put(key, value)


def _positive_int(what: str, value: object) -> int:
    # any integer type that offers __index__ (numpy's, torch's); never a bool
    if not isinstance(value, bool):
        try:
            number = operator.index(value)  # type: ignore[arg-type]
        except TypeError:
            pass
        else:
            if number >= 1:
                return number
    raise InvalidArgumentError(f"{what}: expected a positive integer, got {value!r}")


def _merge_requirements(given: Requirements | Any, **implied: bool) -> Requirements:
    """The layer's declared requirements plus those its arguments imply."""
    base = Requirements.of(given)
    added: dict[str, Any] = {
        name: True for name, on in implied.items() if on and not getattr(base, name)
    }
    return attrs.evolve(base, **added) if added else base


def _softcap(value: object) -> float:
    """``softcap``: ``None`` or 0 is off; otherwise a positive finite number."""
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidArgumentError(f"softcap: expected a positive number or None, got {value!r}")
    cap = float(value)
    if not math.isfinite(cap) or cap < 0:
        raise InvalidArgumentError(
            f"softcap: expected a positive finite number or None, got {value!r}"
        )
    return cap


def _window(value: object) -> tuple[int, int] | None:
    """``window=(left, right)``: each side a count of keys, or None / -1 for unbounded.

    Returns ``(left, right)`` with -1 for an unbounded side, or ``None`` when both
    sides are unbounded (no window at all).
    """
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, (tuple, list)) or len(value) != 2:
        raise InvalidArgumentError(
            f"window: expected (left, right), each a number of keys or None, got {value!r}"
        )
    sides: list[int] = []
    for side in value:
        if side is None or (type(side) is int and side == -1):
            sides.append(-1)
        elif isinstance(side, bool) or not isinstance(side, int) or side < 0:
            raise InvalidArgumentError(
                f"window: each side must be a non-negative integer, or None (-1) for "
                f"unbounded, got {value!r}"
            )
        else:
            sides.append(int(side))
    left, right = sides
    return None if left < 0 and right < 0 else (left, right)


def _layer_spec(
    head_size: int,
    dtype: torch.dtype | str,
    supported: Any,
    default: Backend | str | None,
    role: Role | str,
    requirements: Any,
    causal: bool,
    gqa: bool,
    name: str | None,
    features: tuple[bool, bool, bool] = (False, False, False),
) -> LayerSpec:
    """The layer's spec, memoised on its (hashable) arguments.

    ``features``: whether the layer has a custom scale, a softcap, a window.
    Layers of one shape differ only by name (``blocks.17.attn1``), so the memo
    also holds the nameless spec, and a new name costs a renamed copy: the
    converters and the requirement merge run once per shape, not once per layer.
    """
    key: tuple[object, ...] = (
        head_size,
        dtype,
        supported,
        default,
        role,
        requirements,
        causal,
        gqa,
        features,
    )
    named = (key, name)
    try:
        spec = _SPECS.get(named)  # the same layer built again (a second model)
        if spec is not None:
            return spec
        spec = _SPECS.get(key)
        hashable = True
    except TypeError:  # an unhashable argument (a list of backends): no memo
        spec, hashable = None, False
    if spec is None:
        spec = LayerSpec(
            head_size=head_size,
            dtype=dtype,
            supported=supported,
            default=default,
            role=role,
            requirements=_merge_requirements(
                requirements,
                causal=causal,
                gqa=gqa,
                custom_scale=features[0],
                softcap=features[1],
                sliding_window=features[2],
            ),
        )
        if hashable:
            _memo_put(_SPECS, key, spec)
    if name is None:
        return spec
    spec = attrs.evolve(spec, name=name)
    if hashable:
        _memo_put(_SPECS, named, spec)
    return spec


def _torch_dtypes(names: frozenset[str]) -> frozenset[torch.dtype]:
    found = _DTYPE_SETS.get(names)
    if found is None:
        found = frozenset(_TORCH_DTYPES[n] for n in names if n in _TORCH_DTYPES)
        _memo_put(_DTYPE_SETS, names, found)
    return found


def _describe_dtypes(dtypes: Iterable[torch.dtype]) -> str:
    return ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))


class Attention(FastCallModule):
    """Scaled dot-product attention over (batch, seq, heads, head_size) tensors.

    Resolves its backend once, at construction, in the current
    :func:`~attnres.component_scope` (and under :func:`~attnres.force_backend`
    and the process-wide :class:`~attnres.SelectionConfig`); ``.backend`` and
    ``.resolution`` say what it chose and why, and the decision is recorded in
    :func:`attnres.decisions` under ``name``.

    ``forward(q, k, v, attn_mask=None)``: ``q`` is (batch, seq, num_heads,
    head_size); ``k`` and ``v`` are (batch, seq_kv, num_kv_heads, head_size);
    returns ``q``'s shape. ``attn_mask`` follows torch SDPA: boolean ``True``
    takes part, a float mask is added to the scores; it broadcasts to
    (batch, num_heads, seq, seq_kv). A layer that will receive masks should
    declare ``requirements=Requirements(attn_mask=True)`` so that it is never
    given a kernel that cannot apply them. ``causal`` is top-left aligned like
    SDPA's ``is_causal``; ``softmax_scale`` defaults to ``1/sqrt(head_size)``.
    ``softcap=x`` caps the scaled scores to ``x * tanh(scores / x)``;
    ``window=(left, right)`` is sliding-window attention: query ``i`` sees keys
    ``i - left .. i + right`` (a side of ``None`` is unbounded), top-left
    aligned like ``causal``. A scale other than ``1/sqrt(head_size)``, a softcap
    and a window each add their requirement (``custom_scale``, ``softcap``,
    ``sliding_window``), so the layer never gets a kernel that would ignore it.
    ``num_kv_heads < num_heads`` is grouped-query attention (the layer then
    requires ``gqa``; ``causal=True`` requires ``causal``).

    ``dtype`` (default: torch's default dtype) is what the layer is resolved for;
    ``forward`` accepts any dtype the bound kernel can take.

    Extensions of the SPEC signature: ``backend`` (a request for this one layer,
    origin ``layer``, strict), ``platform`` (resolve against these platform facts
    instead of the detected ones) and ``is_cross_attention`` (a synonym of
    ``role="cross"``; ``False`` means ``role="self"``).

    ``backend_options={"fa": {"deterministic": True}}`` (issue 23) sets typed
    keyword arguments of the kernels this layer may run, per backend, as each
    backend's spec declares them (``BackendSpec.options``, docs/backends.md);
    :class:`~attnres.SelectionConfig`'s ``backend_options`` apply under them.
    They are checked here (:class:`~attnres.errors.BackendOptionError`, with a
    did-you-mean), given to the served backend's kernel when it is bound, and
    recorded in the trace (``LayerSpec.backend_options``).

    Raises at construction: ``ValueError`` for a bad argument,
    :class:`~attnres.ResolutionError` (a ``ValueError``) when no backend can serve
    the layer, :class:`KernelNotRegisteredError` (a ``RuntimeError``) when the
    selected backend has no kernel (sparse backends), and
    :class:`~attnres.kernels.KernelUnavailableError` (an ``ImportError``) when
    its kernel package cannot be imported.
    """

    layer_spec: LayerSpec
    _binding: _Bound | None  # the server's decision, kernel and forward body
    _shape: _LayerShape
    _run: Callable[..., Tensor]  # written by _compose only
    _context: _Context
    _decision: Decision | None  # this layer's one ledger entry
    _awaited_by_scope: bool
    _prepared: dict[str, _Bound]  # per-request bindings (valid for _generation)
    _backward: _Bound | None  # the training binding (valid for _generation)
    _generation: int  # the registry generation _prepared and _backward belong to
    _tuner: object | None  # autotune's settings while armed (attnres.autotuner)
    _switchable: bool  # a request switched this layer once: forward reads the context

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        *,
        num_kv_heads: int | None = None,
        role: Role | str = Role.SELF,
        causal: bool = False,
        supported: Any = None,
        default: Backend | str | None = None,
        requirements: Requirements | Any = None,
        dtype: torch.dtype | str | None = None,
        softmax_scale: float | None = None,
        name: str | None = None,
        backend: Backend | str | None = None,
        is_cross_attention: bool | None = None,
        platform: Platform | None = None,
        softcap: float | None = None,
        window: tuple[int | None, int | None] | None = None,
        preferred: Any = None,
        required: Backend | str | None = None,
        parallel: SequenceParallel | None = None,
        backend_options: Any = None,
    ) -> None:
        super().__init__()
        # (the checks' common case, a plain positive int, costs no call: a model
        # builds the same layer dozens of times)
        if type(num_heads) is not int or num_heads < 1:
            num_heads = _positive_int("num_heads", num_heads)
        if type(head_size) is not int or head_size < 1:
            head_size = _positive_int("head_size", head_size)
        kv_heads = (
            num_heads if num_kv_heads is None else _positive_int("num_kv_heads", num_kv_heads)
        )
        if num_heads % kv_heads:
            raise InvalidArgumentError(
                f"num_kv_heads: {kv_heads} does not divide num_heads {num_heads}; grouped-query "
                f"attention needs num_heads to be a multiple of num_kv_heads"
            )
        if is_cross_attention is not None:
            if not isinstance(is_cross_attention, bool):
                raise InvalidArgumentError(
                    f"is_cross_attention: expected True, False or None, got {is_cross_attention!r}"
                )
            implied = Role.CROSS if is_cross_attention else Role.SELF
            if Role.parse(role) is not implied and Role.parse(role) is not Role.SELF:
                raise InvalidArgumentError(
                    f"role={role!r} contradicts is_cross_attention={is_cross_attention}"
                )
            role = implied
        if type(causal) is not bool:
            if not isinstance(causal, (bool, int)) or causal not in (0, 1):
                raise InvalidArgumentError(f"causal: expected a bool, got {causal!r}")
            causal = bool(causal)
        scale: float | None = None
        if softmax_scale is not None:
            if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
                raise InvalidArgumentError(
                    f"softmax_scale: expected a number or None, got {softmax_scale!r}"
                )
            scale = float(softmax_scale)
            if not math.isfinite(scale):
                raise InvalidArgumentError(
                    f"softmax_scale: expected a finite number, got {softmax_scale!r}"
                )
        cap = 0.0 if softcap is None else _softcap(softcap)
        band = None if window is None else _window(window)
        # issue 32: a layer built again with the same arguments in the same context
        # (48 blocks of a model, a second model) reads its spec, cache entry and
        # binding back from _BUILT; per layer it pays only for its own records
        config: SelectionConfig | None = None
        handle = None
        built: tuple[object, ...] | None = None
        generation = registry_generation()
        if (
            dtype is not None
            and parallel is None
            and backend_options is None
            and (platform is None or isinstance(platform, Platform))
        ):
            try:
                config = capture_config()
                handle = current_handle()
                built = (
                    num_heads,
                    kv_heads,
                    head_size,
                    causal,
                    scale,
                    cap,
                    band,
                    dtype,
                    supported,
                    default,
                    role,
                    requirements,
                    preferred,
                    required,
                    name,
                    backend,
                    config,
                    None if handle is None else handle.state,
                    detected_platform() if platform is None else platform,
                    cache_epoch(),
                )
                known = _BUILT.get(built)
            except (TypeError, ValueError):  # unhashable; a bad config is raised below
                built = None
            else:
                if known is not None:
                    self._built(config, handle, platform, *known)
                    return
        # a scale equal to the default (up to float rounding) is not a custom one
        custom_scale = scale is not None and not math.isclose(scale, head_size**-0.5, rel_tol=1e-9)
        spec = _layer_spec(
            head_size,
            torch.get_default_dtype() if dtype is None else dtype,
            supported,
            default,
            role,
            requirements,
            causal,
            kv_heads != num_heads,
            name,
            (custom_scale, cap > 0, band is not None),
        )
        if preferred is not None or required is not None:
            # issue 23: LayerSpec.preferred / .required (docs/selection-contract.md)
            spec = attrs.evolve(spec, preferred=preferred, required=required)
        # issue 24: a sequence-parallel layout is part of what the layer resolves for
        # (LayerSpec.layout: the machine's layout check); forward runs it (attnres.parallel)
        if parallel is not None:
            if not isinstance(parallel, SequenceParallel):
                raise ArgumentTypeError(
                    f"parallel: expected an attnres.SequenceParallel or None, got "
                    f"{type(parallel).__name__}"
                )
            # issue 35: layout="auto" chooses this layer's layout from its facts
            parallel = parallel.for_layer(num_heads, kv_heads, spec)
            spec = attrs.evolve(spec, layout=parallel.layout(num_heads, kv_heads))
        # issue 23: typed per-backend options (docs/backends.md), the config's under
        # the layer's own; checked here, bound with the kernel, recorded in the trace
        if config is None:
            config = capture_config()
        options = config.backend_options
        if backend_options is not None:
            options = merge_backend_options(options, normalize_backend_options(backend_options))
        if options:
            spec = attrs.evolve(spec, backend_options=options)
        if platform is not None and not isinstance(platform, Platform):
            raise ArgumentTypeError(
                f"platform: expected an attnres.Platform (Platform.detect() or "
                f"Platform.simulate('cuda:sm90+flash_attn')), got {type(platform).__name__}"
            )
        # What the layer resolves with, now or later: the scope, config and forced
        # backend of the place it was built in, never those current at first use.
        if built is None:
            handle = current_handle()
        context = _Context(
            config,
            None if handle is None else handle.state,
            handle,
            platform,
            None if backend is None else optional_backend("backend")(backend),
        )
        shape = _LayerShape(
            num_heads,
            kv_heads,
            head_size,
            causal,
            scale,
            "",
            spec.dtype,
            cap,
            band,
            parallel,
            options,
        )
        # Plain attributes, set without nn.Module.__setattr__'s parameter/module
        # bookkeeping (none of them is a tensor or a module).
        self.__dict__.update(
            layer_spec=spec,
            _binding=None,
            _shape=shape,
            _context=context,
            _decision=None,
            _awaited_by_scope=False,
            _prepared={},
            _backward=None,
            _generation=generation,
            _tuner=None,
            _switchable=False,
        )
        if dtype is None:
            self._compose()  # pending: late binding's forward (else _resolve composes)
        if dtype is not None:
            self._resolve(spec, platform, None if built is None else (built, generation))
        elif handle is not None:
            handle.add_pending()
            self.__dict__["_awaited_by_scope"] = True

    def _built(
        self,
        config: SelectionConfig,
        handle: ScopeHandle | None,
        platform: Platform | None,
        spec: LayerSpec,
        backend: Backend | None,
        found: Any,
        binding: _Bound,
    ) -> None:
        """Construction of a layer built before with the same key of :data:`_BUILT`:
        what :meth:`_resolve` does on a cache hit, with the spec, entry and binding
        known (the hit's audit event, this layer's ledger entry and scope record)."""
        decision: Decision = found[1]
        emit_cache_hit(decision)
        record_decision(decision)
        if handle is not None:
            handle.record(spec.role, decision)
        self.__dict__.update(
            layer_spec=spec,
            _binding=binding,
            _shape=binding.shape,
            _context=_Context(
                config, None if handle is None else handle.state, handle, platform, backend
            ),
            _decision=decision,
            _awaited_by_scope=False,
            _prepared={},
            _backward=None,
            _generation=registry_generation(),
            _tuner=None,
            _switchable=False,
        )
        self._compose()
        if config.autotune:  # opt-in: measured selection
            _arm_autotune(self)

    # -- per-request switching (attnres.request_backend) --------------------------

    def _prepare(self, backend: Backend) -> _Bound:
        """The resolution and bound forward of ``backend`` for one request (origin
        ``request``, strict, traced, not recorded), cached per layer."""
        self._check_generation()
        prepared: _Bound | None = self._prepared.get(backend.name)
        if prepared is not None:
            return prepared
        current = self._server_resolution()
        if current is None:  # pragma: no cover - request_backend binds first
            raise InvalidStateError(
                "attnres.Attention: prepare a request on a bound layer (attnres.bind first)"
            )
        ctx, spec = self._context, self.layer_spec
        resolution, _, trace = lookup(
            spec,
            ctx.config,
            ctx.scope,
            current.trace.input.platform,
            ctx.backend,
            backend,
            needs_kernel=True,
        )
        if resolution is None:
            raise rejection(trace)
        kernel, dtypes = _bind(resolution, spec)
        shape = self._shape._replace(backend=resolution.backend.name, origin=str(resolution.origin))
        prepared = _Bound(resolution, kernel, shape, _make_run(shape, kernel, dtypes))
        self._prepared[backend.name] = prepared
        return prepared

    def _requested(self) -> _Bound | None:
        """The binding this context's request (:func:`attnres.request_backend`) asks
        this layer to run, or ``None`` (no request for it here)."""
        if not self._switchable:
            return None
        backend = _REQUESTS.get().get(id(self))
        return None if backend is None else self._prepare(backend)

    def _make_switchable(self) -> None:
        """From now on ``forward`` follows the caller's request (a context variable:
        each thread and asyncio task sees its own). Layers no request ever switched
        keep the plain forward."""
        if not self._switchable:
            with _BIND_LOCK:
                self.__dict__["_switchable"] = True
                self._compose()

    def _check_generation(self) -> None:
        """Drop the per-request and training bindings made against an older registry."""
        generation = registry_generation()
        if self._generation != generation:
            self.__dict__.update(_prepared={}, _backward=None, _generation=generation)

    # -- the one writer of the forward ---------------------------------------------

    def _compose(self) -> None:
        """Build ``forward`` from the binding and the policies that wrap it.

        The only place ``_run`` is written. Innermost first: the binding's body
        (or late binding's resolve-then-run while pending); the training guard
        (only when the bound kernel may lack a backward pass); autotune's
        measuring wrapper (while armed); the per-request switch (only once a
        request switched this layer). A layer with none of them runs the
        binding's body itself.
        """
        binding = self._binding
        run: Callable[..., Tensor]
        if binding is None:
            run = _pending_run(weakref.ref(self))
        else:
            run = self._guard(binding)
            if self._tuner is not None:
                run = _tuning(weakref.ref(self), run, self._tuner)
        if self._switchable:
            run = _switching(weakref.ref(self), run)
        self.__dict__["_run"] = run

    def _set_binding(self, binding: _Bound, *, tuner: object | None = None) -> None:
        """Run ``binding`` from now on (a new decision: requests and training are
        prepared again for it)."""
        self.__dict__.update(
            _binding=binding,
            _shape=binding.shape,
            _prepared={},
            _backward=None,
            _generation=registry_generation(),
            _tuner=tuner,
        )
        self._compose()

    def _set_tuner(self, tuner: object | None) -> None:
        """Arm (settings) or disarm (``None``) autotune's measuring wrapper."""
        self.__dict__["_tuner"] = tuner
        self._compose()

    def _server_resolution(self) -> Resolution | None:
        binding = self._binding
        return None if binding is None else binding.resolution

    @property
    def resolution(self) -> Resolution | None:
        """The decision this layer runs here and now (a request's inside
        :func:`attnres.request_backend`); ``None`` while pending."""
        requested = self._requested()
        if requested is not None:
            return requested.resolution
        return self._server_resolution()

    @property
    def kernel(self) -> KernelFn | None:
        """The kernel this layer runs here and now; ``None`` while pending."""
        bound = self._requested() or self._binding
        return None if bound is None else bound.kernel

    # -- training: a forward that needs gradients needs a backward pass -----------

    def _backward_spec(self) -> LayerSpec:
        return training_spec(self.layer_spec)  # the machine's training rule

    def _guard(self, binding: _Bound) -> Callable[..., Tensor]:
        """``binding``'s forward, or -- when the bound kernel has no backward pass and
        the layer did not require one -- that forward behind a check for forwards
        that need gradients.

        Only such layers pay for the check (one grad-mode call and three flags);
        every other bound layer runs the binding's forward itself.
        """
        run, resolution = binding.run, binding.resolution
        if resolution is None:
            return run
        spec = self.layer_spec
        # the answer for this (resolution, spec) pair, kept while the registry stands
        # (identical objects only: a layer built again reuses both from the caches)
        known = _GUARDED.get(id(resolution))
        if known is not None and known[0] is resolution and (known[1] is spec or known[1] == spec):
            guarded = known[2]
        else:
            guarded = not self._has_backward(resolution, spec)
            _memo_put(_GUARDED, id(resolution), (resolution, spec, guarded))
        return _grad_guard(run, weakref.ref(self)) if guarded else run

    @staticmethod
    def _has_backward(resolution: Resolution, spec: LayerSpec) -> bool:
        """Whether ``resolution``'s kernel serves the forwards that need gradients
        (or the layer required a backward pass, so it has one)."""
        if spec.requirements.backward:
            return True
        facts = lookup_spec(resolution.backend)
        # issue 24: under a layout a ring's lse may carry no gradient (the layout check)
        if facts is not None and backward_everywhere(facts) and spec.layout is None:
            return True  # a backward pass everywhere (torch_sdpa, eager, ...): no check
        platform = resolution.trace.input.platform
        # only the requirements check can differ from the inference decision's
        key = (resolution.backend, spec.requirements, spec.role, platform)
        has_backward = _HAS_BACKWARD.get(key)
        if has_backward is None:
            has_backward = has_backward_pass(resolution.backend, spec, platform)
            _memo_put(_HAS_BACKWARD, key, has_backward)
        return has_backward

    @property
    def backward_resolution(self) -> Resolution | None:
        """The decision for forwards that need gradients, when the bound kernel has
        no backward pass and one has run (kept beside the inference decision)."""
        bound = self._backward
        return None if bound is None else bound.resolution

    def _training_run(self) -> Callable[..., Tensor]:
        """The forward for inputs that need gradients: resolved once with the
        ``backward`` requirement added (traced, not recorded in the ledger, like a
        request's), so a relaxed decision falls back and a strict one raises a
        :class:`~attnres.ResolutionError` before anything is computed."""
        self._check_generation()
        bound = self._backward
        if bound is None:
            current = self._server_resolution()
            if current is None:  # pragma: no cover - only bound layers are guarded
                raise InvalidStateError(
                    "attnres.Attention: a pending layer has no training path (attnres.bind first)"
                )
            ctx, spec = self._context, self._backward_spec()
            resolution, _, trace = lookup(
                spec,
                ctx.config,
                ctx.scope,
                current.trace.input.platform,
                ctx.backend,
                needs_kernel=True,
            )
            if resolution is None:
                error = rejection(trace)
                raise type(error)(
                    f"{error} (attnres.Attention{_named(self.layer_spec)} runs "
                    f"{current.backend.name!r}, which has no backward pass here, and this "
                    f"forward needs gradients; nothing was computed)",
                    error.trace,
                    error.code,
                ) from None
            kernel, dtypes = _bind(resolution, spec)
            shape = self._shape._replace(
                backend=resolution.backend.name, origin=str(resolution.origin)
            )
            bound = _Bound(resolution, kernel, shape, _make_run(shape, kernel, dtypes))
            self.__dict__["_backward"] = bound
        return bound.run

    # -- late binding -------------------------------------------------------------

    @property
    def pending(self) -> bool:
        """Whether the layer has not resolved yet (built without ``dtype``, not yet
        cast, run or bound); ``.backend`` and ``.resolution`` are ``None`` until then."""
        return self._binding is None

    def _resolve(
        self,
        spec: LayerSpec,
        platform: Platform | None,
        built: tuple[tuple[object, ...], int] | None = None,
    ) -> Resolution:
        """Resolve for ``spec`` (its dtype) with the captured context and bind.

        The first resolution records the decision in the ledger and the scope the
        layer was built in (checking that scope's overrides if it has exited);
        a later one (a cast) replaces the stale ledger entry. ``built``: the
        construction's key of :data:`_BUILT` and the registry generation read
        before it (that memo then keeps the spec, entry and binding).
        """
        ctx = self._context
        first = self._binding is None
        found = lookup(
            spec,
            ctx.config,
            ctx.scope,
            ctx.platform if platform is None else platform,
            ctx.backend,
            needs_kernel=True,
        )
        resolution, decision, trace = found
        handle = ctx.handle if first else None
        awaited = first and self._awaited_by_scope
        if first:
            record_decision(decision)
            if handle is not None:
                handle.record(spec.role, decision)
        elif resolution is not None:
            replace_decision(self._decision, decision)
        if resolution is None:
            if awaited and handle is not None:
                self.__dict__["_awaited_by_scope"] = False
                # the rejection is the error to report
                with contextlib.suppress(BackendNotAppliedError):
                    bind_pending(handle, spec.role, None)
            raise rejection(trace)
        self.__dict__.update(layer_spec=spec, _decision=decision)
        binding = self._bound(found, resolution, spec)
        self._set_binding(binding)
        if built is not None:
            with _MEMO_LOCK:
                _BUILT.put(built[0], (spec, ctx.backend, found, binding), built[1])
        if resolution.trace.input.config.autotune:  # opt-in: measured selection
            _arm_autotune(self)
        if awaited and handle is not None:
            self.__dict__["_awaited_by_scope"] = False
            bind_pending(handle, spec.role, decision)
        return resolution

    def _bound(self, found: object, resolution: Resolution, spec: LayerSpec) -> _Bound:
        """The binding of ``resolution`` (``found``: :func:`lookup`'s cache entry that
        holds it) for ``spec`` and this layer's shape.

        It depends on nothing else (the entry's input holds a spec equal to
        ``spec``), and the entry is the cache's own object for one input under one
        registry generation: a layer built again (a second model) reads its
        binding back rather than binding the kernel anew.
        """
        key: tuple[int, _LayerShape] | None = (id(found), self._shape)
        try:
            known = _BINDINGS.get(key)  # type: ignore[arg-type]
        except TypeError:  # an unhashable shape field: no memo
            known, key = None, None
        if known is not None and known[0] is found:
            return known[1]
        generation = registry_generation()
        kernel, dtypes = _bind(resolution, spec)
        shape = self._shape._replace(
            backend=resolution.backend.name, dtype=spec.dtype, origin=str(resolution.origin)
        )
        bound = _Bound(resolution, kernel, shape, _make_run(shape, kernel, dtypes))
        if key is not None:
            with _MEMO_LOCK:
                _BINDINGS.put(key, (found, bound), generation)
        return bound

    def _bind_to(self, dtype: Any = None, platform: Platform | None = None) -> Resolution:
        """Resolve now if pending or stale (another dtype or platform); else keep."""
        spec = self.layer_spec
        if dtype is not None:
            name = normalize_dtype(dtype)
            if name != spec.dtype:
                spec = attrs.evolve(spec, dtype=name)
        current = self._server_resolution()
        if (
            current is not None
            and spec is self.layer_spec
            and (platform is None or platform == current.trace.input.platform)
        ):
            return current
        with _BIND_LOCK:
            return self._resolve(spec, platform)

    def _first_forward(self, q: Tensor) -> None:
        if self._binding is not None:  # another thread bound it meanwhile
            return
        if torch.compiler.is_dynamo_compiling():  # this code traced (not another thread)
            raise CompiledGraphError(
                f"attnres.Attention{_named(self.layer_spec)} is still pending (built without "
                f"dtype, never cast or bound) inside torch.compile: call attnres.bind(model) "
                f"(or cast the model) before compiling, so the decision is made outside the graph"
            )
        dtype = getattr(q, "dtype", None)
        if not isinstance(dtype, torch.dtype):
            raise InvalidArgumentError(f"q: expected a tensor, got {type(q).__name__}")
        try:
            normalize_dtype(dtype)
        except ValueError:  # no attention dtype (int32): resolve for the layer's own,
            dtype = None  # and forward's input check says what is wrong with q
        self._bind_to(dtype)

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> Attention:
        # nn.Module.to / .half / .bfloat16 / .float / .double all come here: the
        # layer follows a dtype cast as parameters do, and resolves for it.
        # fn converts tensors; a dtype cast is told from a device move by two
        # empty probes of different floating dtypes: a cast changes at least one
        new: torch.dtype | None = None
        for probe_dtype in (torch.float64, torch.float16):
            try:
                probe = fn(torch.empty(0, dtype=probe_dtype))
            except Exception:  # a device move this machine cannot make: not a cast
                new = None
                break
            found = getattr(probe, "dtype", probe_dtype)
            if found is not probe_dtype and isinstance(found, torch.dtype):
                new = found
                break
        if new is not None:
            try:
                normalize_dtype(new)
            except ValueError:
                new = None  # a dtype no attention kernel takes: forward will say so
        if new is not None:
            # issue 20, 5: resolve before anything is cast. Cast on its own, a layer
            # refuses a dtype no backend serves and changes nothing. Inside a model
            # being cast (called from a parent's nn.Module._apply), raising would
            # leave the model half-cast (the modules before it cast, those after
            # not): the cast completes, the layer keeps its decision, and forward
            # refuses inputs of that dtype, naming the dtype it was resolved for.
            nested = sys._getframe(1).f_code is nn.Module._apply.__code__
            try:
                self._bind_to(new)
            except ValueError:
                if not nested:
                    raise
        super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        return self

    # The configuration is fixed at construction (forward binds it): read-only.
    @property
    def num_heads(self) -> int:
        return self._shape.num_heads

    @property
    def num_kv_heads(self) -> int:
        return self._shape.num_kv_heads

    @property
    def head_size(self) -> int:
        return self._shape.head_size

    @property
    def causal(self) -> bool:
        return self._shape.causal

    @property
    def softmax_scale(self) -> float | None:
        """The scale given at construction; ``None`` means ``1/sqrt(head_size)``."""
        return self._shape.softmax_scale

    @property
    def softcap(self) -> float | None:
        """The softcap given at construction; ``None`` when there is none."""
        return self._shape.softcap or None

    @property
    def window(self) -> tuple[int | None, int | None] | None:
        """``(left, right)`` of the sliding window (``None`` per unbounded side), or ``None``."""
        band = self._shape.window
        if band is None:
            return None
        return (None if band[0] < 0 else band[0], None if band[1] < 0 else band[1])

    @property
    def role(self) -> Role:
        return self.layer_spec.role

    @property
    def backend(self) -> Backend | None:
        """The backend this layer runs (``.resolution`` says why); ``None`` while pending."""
        resolution = self.resolution
        return None if resolution is None else resolution.backend

    def forward(self, q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None) -> Tensor:
        return self._run(q, k, v, attn_mask)

    def extra_repr(self) -> str:
        resolution = self.resolution
        head = (
            f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
            f"head_size={self.head_size}, role={self.role.value}, causal={self.causal}, "
        )
        extras = (f", softcap={self.softcap}" if self.softcap else "") + (
            f", window={self.window}" if self.window else ""
        )
        if resolution is None:
            return head + f"backend=pending (dtype {self.layer_spec.dtype} so far)" + extras
        return (
            head
            + f"backend={resolution.backend.name}"
            + extras
            + (f", reason={str(resolution.reason)!r}" if resolution.reason else "")
        )

    # The bound kernel and the forward closure are not picklable: pickling keeps
    # the decision and binds the same backend's kernel again on load, without
    # resolving; a pending layer stays pending (with the scope it was built in).
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_run", None)
        state["_binding"] = None
        state["_pickled_resolution"] = self._server_resolution()
        state["_prepared"] = {}
        state["_backward"] = None
        state["_decision"] = None
        state["_awaited_by_scope"] = False
        state["_tuner"] = None
        state["_switchable"] = False
        state["_context"] = self._context._replace(handle=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        resolution = state.pop("_pickled_resolution", None)
        super().__setstate__(state)  # type: ignore[no-untyped-call]
        self.__dict__["_generation"] = registry_generation()
        if resolution is None:
            self._compose()
            return
        kernel, dtypes = _bind(resolution, self.layer_spec)
        self._set_binding(
            _Bound(resolution, kernel, self._shape, _make_run(self._shape, kernel, dtypes))
        )
        if resolution.trace.input.config.autotune:
            _arm_autotune(self)

    def _adopt(self, resolution: Resolution) -> Decision:
        """Run ``resolution``'s backend from now on (autotune's measured decision);
        the layer's ledger entry becomes the new decision (returned)."""
        kernel, dtypes = _bind(resolution, self.layer_spec)
        shape = self._shape._replace(backend=resolution.backend.name, origin=str(resolution.origin))
        decision = Decision(
            resolution.component, resolution.layer, resolution.outcome, resolution.trace
        )
        replace_decision(self._decision, decision)
        self.__dict__["_decision"] = decision
        self._set_binding(_Bound(resolution, kernel, shape, _make_run(shape, kernel, dtypes)))
        return decision


def _arm_autotune(layer: Attention) -> None:
    """Arm the layer's tuner when its decision is automatic (attnres.autotuner)."""
    arm(layer)


#: layer id -> the backend this context's request asks it to run
#: (:func:`attnres.request_backend` sets it; never mutated, replaced per request)
_REQUESTS: contextvars.ContextVar[Mapping[int, Backend]] = contextvars.ContextVar(
    "attnres_requests", default=MappingProxyType({})
)


def _switching(
    ref: weakref.ReferenceType[Attention], run: Callable[..., Tensor]
) -> Callable[..., Tensor]:
    """``run``, unless this context's request asks the layer for another backend."""
    requests = _REQUESTS.get
    key = id(ref())

    def switching(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None) -> Tensor:
        backend = requests().get(key)
        if backend is None:
            return run(q, k, v, attn_mask)
        layer = ref()
        if layer is None:  # pragma: no cover - the closure outlived its layer
            return run(q, k, v, attn_mask)
        # is_dynamo_compiling, not is_compiling: the latter is a process-wide flag,
        # true in every thread while any thread compiles (flex_attention does)
        if torch.compiler.is_dynamo_compiling():
            raise CompiledGraphError(
                f"attnres.Attention{_named(layer.layer_spec)} is being compiled by "
                f"torch.compile inside attnres.request_backend({backend.name!r}): the graph "
                f"would keep one request's kernel. Compile the model for one backend and "
                f"switch only modules that are not compiled"
            )
        out: Tensor = layer._prepare(backend).run(q, k, v, attn_mask)
        return out

    return switching


def _tuning(
    ref: weakref.ReferenceType[Attention], run: Callable[..., Tensor], tuner: object
) -> Callable[..., Tensor]:
    return armed_run(ref, run, tuner)


_BIND_LOCK = threading.RLock()


class _Bound(NamedTuple):
    """What a layer runs: its decision, kernel and forward (swapped per request)."""

    resolution: Resolution | None
    kernel: KernelFn | None
    shape: _LayerShape
    run: Callable[..., Tensor]


class _Context(NamedTuple):
    """What a layer resolves with, captured when it was built."""

    config: SelectionConfig
    scope: ScopeState | None
    handle: ScopeHandle | None  # the open scope, to record the decision in
    platform: Platform | None
    backend: Backend | None  # the layer's own backend= (origin layer)


def _grad_guard(
    run: Callable[..., Tensor], ref: weakref.ReferenceType[Attention]
) -> Callable[..., Tensor]:
    """``run`` for inference; the layer's training path for inputs that need gradients
    (grad mode on and an input that requires grad; ``module.train()`` alone is not)."""
    grad_enabled = torch.is_grad_enabled

    def guarded(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None) -> Tensor:
        if grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            layer = ref()
            if layer is not None:
                out: Tensor = layer._training_run()(q, k, v, attn_mask)
                return out
        return run(q, k, v, attn_mask)

    return guarded


def _named(spec: LayerSpec) -> str:
    return f" {spec.name!r}" if spec.name else ""


def _pending_run(ref: weakref.ReferenceType[Attention]) -> Callable[..., Tensor]:
    """The forward of a pending layer: resolve for the query's dtype, then run."""

    def run(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None) -> Tensor:
        layer = ref()
        if layer is None:  # pragma: no cover - the closure outlived its layer
            raise InvalidStateError(
                "attnres.Attention: the layer was garbage-collected; keep the module alive"
            )
        layer._first_forward(q)
        out: Tensor = layer._run(q, k, v, attn_mask)
        return out

    return run


def bind(
    module: nn.Module, *, dtype: torch.dtype | str | None = None, platform: Platform | None = None
) -> list[Resolution]:
    """Resolve every pending or stale ``attnres.Attention`` under ``module`` now.

    ``dtype``: resolve for this dtype (default: each layer's current one: torch's
    default dtype at construction, or the dtype of the last cast); ``platform``:
    resolve against these facts (default: the layer's own, else the detected
    platform). A layer already resolved for them keeps its decision. Returns the
    resolutions in ``module.modules()`` order; a layer that cannot be served
    raises its :class:`~attnres.ResolutionError` (so a server can fail fast at
    start-up, not at its first request).
    """
    if not isinstance(module, nn.Module):
        raise ArgumentTypeError(
            f"attnres.bind: expected a torch.nn.Module, got {type(module).__name__}"
        )
    if dtype is not None:
        normalize_dtype(dtype)  # a bad dtype is an error before any layer changes
    if platform is not None and not isinstance(platform, Platform):
        raise ArgumentTypeError(
            f"attnres.bind: platform must be an attnres.Platform, got {platform!r}"
        )
    return [m._bind_to(dtype, platform) for m in module.modules() if isinstance(m, Attention)]


class _LayerShape(NamedTuple):
    """What ``forward`` checks and passes on: fixed at construction."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    causal: bool
    softmax_scale: float | None
    backend: str
    dtype: str  # the dtype the layer was resolved for
    softcap: float = 0.0  # 0: none
    window: tuple[int, int] | None = None  # (left, right), -1 unbounded
    parallel: SequenceParallel | None = None  # issue 24: the sequence-parallel layout
    backend_options: BackendOptions = ()  # issue 23: per backend, validated
    #: how the backend was chosen (the resolution's origin): a sequence-parallel
    #: layer's consensus compares it across ranks (issue 32 item 17)
    origin: str = "none"


def _make_run(
    shape: _LayerShape, kernel: KernelFn, dtypes: frozenset[torch.dtype]
) -> Callable[..., Tensor]:
    """The body of ``forward``, with everything it reads bound as closure cells.

    On an ``nn.Module`` every ``self.x`` goes through the class's ``__getattr__``
    hook (about 20 ns each); a closure cell costs nothing, and the closure holds
    no reference to the layer -- so layers of one shape bound to one kernel share
    one closure (memoised: 48 blocks build it once, not 48 times).
    """
    key = (shape, kernel, dtypes)
    try:
        run = _RUNS.get(key)
    except TypeError:  # an unhashable kernel object: no memo
        return _new_run(shape, kernel, dtypes)
    if run is None:
        run = _new_run(shape, kernel, dtypes)
        _memo_put(_RUNS, key, run)
    return run


#: The mask dtypes torch SDPA takes: boolean, or a float bias (read once per call)
_MASK_DTYPES: Final = frozenset(
    {torch.bool, torch.float16, torch.bfloat16, torch.float32, torch.float64}
)


def _new_run(
    shape: _LayerShape, kernel: KernelFn, dtypes: frozenset[torch.dtype]
) -> Callable[..., Tensor]:
    if shape.parallel is not None:  # issue 24: collectives around a per-rank local run
        return shape.parallel.make_run(shape, kernel, dtypes, _new_run)
    heads_q, heads_kv, head_size, causal, scale = shape[:5]
    options = dict(shape.backend_options).get(shape.backend, ())  # issue 23: bound once
    call = specialized(
        kernel,
        causal,
        scale,
        heads_q != heads_kv,
        softcap=shape.softcap,
        window=shape.window,
        options=options,
    )

    def run(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None) -> Tensor:
        # Three shapes and one dtype are read; anything else a kernel would refuse
        # (q/k/v dtypes that differ, ...) is diagnosed only if the kernel raises.
        try:
            batch, _, heads, size = q.shape
            kv_shape = k.shape
            kv_batch, _, kv_heads, kv_size = kv_shape
        except ValueError:
            raise _mismatch(shape, dtypes, q, k, v) from None
        if (
            heads != heads_q
            or size != head_size
            or kv_heads != heads_kv
            or kv_size != head_size
            or kv_batch != batch
            or v.shape != kv_shape
            or q.dtype not in dtypes
        ):
            raise _mismatch(shape, dtypes, q, k, v)
        if attn_mask is not None and attn_mask.dtype not in _MASK_DTYPES:
            refuse_integer_mask(attn_mask)  # issue 32 item 1: every kernel alike
        try:
            out = call(q, k, v, attn_mask)
        except (RuntimeError, TypeError) as exc:
            mismatch = _mismatch(shape, dtypes, q, k, v, strict=True)
            if mismatch is None:
                raise
            raise mismatch from exc
        return out

    return run


@overload
def _mismatch(
    shape: _LayerShape, dtypes: frozenset[torch.dtype], q: Tensor, k: Tensor, v: Tensor
) -> InvalidArgumentError: ...
@overload
def _mismatch(
    shape: _LayerShape,
    dtypes: frozenset[torch.dtype],
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    strict: bool,
) -> InvalidArgumentError | None: ...


def _mismatch(
    shape: _LayerShape,
    dtypes: frozenset[torch.dtype],
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    strict: bool = False,
) -> InvalidArgumentError | None:
    """What did not match the layer, as an :class:`InvalidArgumentError` (a ``ValueError``).

    For inputs ``forward`` refused; with ``strict``, after the kernel raised:
    ``None`` when the inputs match the layer (the kernel's own error stands).
    """
    h, hk, d = shape.num_heads, shape.num_kv_heads, shape.head_size
    shapes = f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    expect = f"this layer takes q (batch, seq, {h}, {d}) and k, v (batch, seq_kv, {hk}, {d})"
    for label, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            return InvalidArgumentError(
                f"rank: {label} must have 4 dims (batch, seq, heads, head_size), got "
                f"{t.dim()}; {shapes}"
            )
    if q.shape[3] != d or k.shape[3] != d or v.shape[3] != d:
        return InvalidArgumentError(f"head size: expected {d}; {shapes}; {expect}")
    if q.shape[2] != h:
        return InvalidArgumentError(
            f"heads: q has {q.shape[2]} heads, expected {h}; {shapes}; {expect}"
        )
    if k.shape[2] != hk or v.shape[2] != hk:
        gqa = f" (grouped-query: {h} query heads share {hk})" if hk != h else ""
        return InvalidArgumentError(f"heads: k and v must have {hk} heads{gqa}; {shapes}; {expect}")
    if q.shape[0] != k.shape[0] or v.shape[0] != k.shape[0]:
        return InvalidArgumentError(f"batch: q, k and v must have the same batch size; {shapes}")
    if v.shape != k.shape:
        return InvalidArgumentError(f"seq_kv: k and v must have the same shape; {shapes}")
    if q.dtype not in dtypes:
        return InvalidArgumentError(
            f"dtype: backend {shape.backend!r} cannot take {q.dtype} (it takes "
            f"{_describe_dtypes(dtypes)}); this layer was resolved for {shape.dtype}"
        )
    if k.dtype != q.dtype or v.dtype != q.dtype:
        return InvalidArgumentError(
            f"dtype: q, k and v must have the same dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if strict:
        return None
    raise AssertionError(f"forward refused inputs that match the layer; {shapes}")


def _where(resolution: Resolution, spec: LayerSpec) -> str:
    """`` for layer 'x' of component 'y'``, for the errors of :func:`_bind`."""
    where = f" for layer {spec.name!r}" if spec.name else ""
    if resolution.component is not None:
        where += f" of component {resolution.component!r}"
    return where


def _bind(resolution: Resolution, spec: LayerSpec) -> tuple[KernelFn, frozenset[torch.dtype]]:
    """The kernel of the selected backend and the torch dtypes it takes."""
    backend = resolution.backend
    name = backend.name
    if spec.backend_options:  # issue 23: the device's function takes the options
        check_layer_options(
            lookup_spec(backend), spec, resolution.trace.input.platform, _where(resolution, spec)
        )
    # issue 22: a key-padding layer on a varlen kernel runs the unpad route
    mask_key = (name, spec.requirements.mask, spec.requirements.causal_alignment)
    bound = _BOUND.get(mask_key)
    if bound is not None:
        return bound
    try:
        kernel = get_kernel(name)
    except KernelUnavailableError as exc:
        where = _where(resolution, spec)
        raise KernelUnavailableError(
            f"Attention backend {name!r} was selected{where} (origin {resolution.origin}), but "
            f"its kernel cannot be loaded: {exc}",
            name=exc.name,
        ) from exc
    backend_spec = lookup_spec(backend)
    if kernel is None or backend_spec is None:
        where = _where(resolution, spec)
        kind = "sparse " if backend_spec is not None and backend_spec.sparse else ""
        why = (
            "sparse kernels need model-specific layout metadata that the dense calling "
            "convention does not carry"
            if kind
            else "no kernel is registered for it"
        )
        raise KernelNotRegisteredError(
            f"Attention backend {name!r} was selected{where} (origin {resolution.origin}), but "
            f"attnres has no kernel for this {kind}backend ({why}). Register one with "
            f"attnres.kernels.register_kernel({name!r}, fn), where fn(q, k, v, attn_mask, "
            f"causal, scale) takes (batch, seq, heads, head_size) tensors and returns q's "
            f"shape, or choose a dense backend for this layer; see docs/layers.md",
            backend,
            resolution,
        )
    kernel = route_kernel(
        backend_spec, kernel, spec.requirements.mask, spec.requirements.causal_alignment
    )
    bound = (kernel, _torch_dtypes(backend_spec.dtypes))
    _memo_put(_BOUND, mask_key, bound)
    return bound
