"""Issue 24: kernels that return the softmax log-sum-exp, for ring attention.

A ring layout (:mod:`attnres.parallel`) runs the local kernel once per key/value
block and merges the partial outputs by their log-sum-exp, so it calls an
*lse kernel*::

    attention_lse(q, k, v, causal, scale, softcap=0.0) -> (out, lse)
    # q: (batch, seq_q, heads_q, head_size); k, v: (batch, seq_kv, heads_kv, head_size)
    # causal: top-left aligned; scale: None = 1/sqrt(head_size)
    # out: q's shape and dtype; lse: (batch, heads_q, seq_q), float32 (float64 for float64 q)

Which backends *can* return it is a catalogue fact (``BackendSpec.lse``); which
have an adapter in this process is :func:`has_lse_kernel` (the machine's
``layout`` check reads both for a layer that will run). Adapters here:

- ``eager``: the reference math (float32 accumulation; float64 stays float64);
  differentiable in both outputs;
- ``torch_sdpa``: on CPU, ``aten::_scaled_dot_product_flash_attention_for_cpu``
  returns ``(output, logsumexp)`` in one fused call (torch 2.13's schema:
  ``(query, key, value, dropout_p, is_causal, *, attn_mask, scale)``, heads-first
  layout, equal head counts). Its logsumexp carries no gradient, so a forward
  that needs gradients (grad mode on and an input that requires grad) takes SDPA
  for the output and one extra ``q @ k^T`` for a differentiable lse; so does
  every other device (the fused CUDA entry points are not wired yet);
- ``fa``: ``flash_attn_func(..., return_attn_probs=True)`` (:func:`make_fa_lse`);
- ``sage_attn``: ``sageattn(..., return_lse=True)`` (:func:`make_sage_lse`);
  inference only (no backward pass at all).

Issue 35: a ring trains by recomputation, as ring-flash-attention does: its
forward keeps no graph (only q, its own key/value block, the merged output and
the merged log-sum-exp, all linear in the sequence), and its backward asks a
*block backward* for each block again::

    attention_lse_backward(dout, q, k, v, out, lse, causal, scale, softcap=0.0)
        -> (dq, dk, dv)
    # out, lse: the MERGED output and log-sum-exp of q's rows over every block

Given the merged statistics, a flash-attention backward over one block returns
exactly that block's share of the gradients (``P = exp(S - lse)`` is the block's
slice of the full softmax, ``D = rowsum(dout * out)`` the full row's). Block
backwards here (:func:`get_lse_backward`): ``eager`` (the math), ``torch_sdpa``
(``aten::_scaled_dot_product_flash_attention_for_cpu_backward`` on CPU, memory
linear in the sequence; the math elsewhere), ``fa`` (flash-attn's
``_flash_attn_backward``, what diffusers' and ring-flash-attention's rings call).

Nothing is imported at module import: torch is loaded on the first call.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from attnres._memo import GenerationMemo
from attnres.errors import InvalidArgumentError
from attnres.kernels._common import (
    KernelUnavailableError,
    import_kernel_package,
    kernel_function,
    require_attribute,
    takes_keywords,
)

if TYPE_CHECKING:
    import torch
    from torch import Tensor

__all__ = [
    "LseBackwardFn",
    "LseKernelFn",
    "clear_lse_cache",
    "get_lse_backward",
    "get_lse_kernel",
    "has_lse_kernel",
    "lse_has_gradient",
    "lse_kernel_names",
]

#: ``attention_lse(q, k, v, causal, scale, softcap=0.0, **options) -> (out, lse)``;
#: ``options``: the backend's validated options (issue 23), only where it has any
LseKernelFn = Callable[..., "tuple[Tensor, Tensor]"]
#: ``attention_lse_backward(dout, q, k, v, out, lse, causal, scale, softcap=0.0,
#: **options) -> (dq, dk, dv)`` with the merged ``out`` and ``lse`` (issue 35)
LseBackwardFn = Callable[..., "tuple[Tensor, Tensor, Tensor]"]


def _heads_first(t: Tensor, groups: int) -> Tensor:
    """(b, s, h, d) -> (b, h * groups, s, d): GQA's key/value heads repeated."""
    out = t.transpose(1, 2)
    return out.repeat_interleave(groups, dim=1) if groups > 1 else out


def _compute_dtype(q: Tensor) -> torch.dtype:
    import torch

    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _scores(q: Tensor, k: Tensor, causal: bool, scale: float | None, softcap: float) -> Tensor:
    """The scaled (and capped, masked) scores, heads first, in the compute dtype."""
    import torch

    dtype = _compute_dtype(q)
    groups = q.shape[2] // k.shape[2]
    qh = q.transpose(1, 2).to(dtype)
    kh = _heads_first(k, groups).to(dtype)
    scores: Tensor = (qh @ kh.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if causal:
        sq, skv = q.shape[1], k.shape[1]
        keep = torch.ones(sq, skv, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    return scores


def eager_lse(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float | None, softcap: float = 0.0
) -> tuple[Tensor, Tensor]:
    """The reference math, returning the log-sum-exp too (differentiable)."""
    import torch

    scores = _scores(q, k, causal, scale, softcap)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    vh = _heads_first(v, q.shape[2] // v.shape[2]).to(probs.dtype)
    out = (probs @ vh).transpose(1, 2).to(q.dtype)
    return out, lse


def eager_lse_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
    scale: float | None, softcap: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """One block's share of the gradients from the merged ``out`` and ``lse`` (the
    math of flash attention's backward, in the compute dtype; GQA folded back)."""
    import torch

    dtype = _compute_dtype(q)
    groups = q.shape[2] // k.shape[2]
    raw = _scores(q, k, False, scale, 0.0)
    scores = softcap * torch.tanh(raw / softcap) if softcap else raw
    if causal:
        keep = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    probs = torch.exp(scores - lse.to(dtype).unsqueeze(-1))
    do = dout.transpose(1, 2).to(dtype)
    vh = _heads_first(v, groups).to(dtype)
    dv = probs.transpose(-1, -2) @ do
    rows = (do * out.transpose(1, 2).to(dtype)).sum(-1, keepdim=True)
    ds = probs * (do @ vh.transpose(-1, -2) - rows)
    if softcap:
        ds = ds * (1 - (scores.masked_fill(torch.isinf(scores), 0.0) / softcap) ** 2)
    ds = ds * (q.shape[-1] ** -0.5 if scale is None else scale)
    dq = ds @ _heads_first(k, groups).to(dtype)
    dk = ds.transpose(-1, -2) @ q.transpose(1, 2).to(dtype)
    return dq.transpose(1, 2), _fold_heads(dk, groups), _fold_heads(dv, groups)


def _fold_heads(grad: Tensor, groups: int) -> Tensor:
    """(b, h * groups, s, d) heads first -> (b, s, h, d): GQA's repeated heads summed."""
    if groups > 1:
        b, heads, s, d = grad.shape
        grad = grad.reshape(b, heads // groups, groups, s, d).sum(2)
    return grad.transpose(1, 2)


def sdpa_lse(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float | None, softcap: float = 0.0
) -> tuple[Tensor, Tensor]:
    """torch SDPA's output and log-sum-exp (the fused CPU entry point when it can)."""
    import torch

    if softcap:
        raise InvalidArgumentError(
            "torch_sdpa has no softcap argument (attnres refuses softcap for it)"
        )
    groups = q.shape[2] // k.shape[2]
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    qh, kh, vh = q.transpose(1, 2), _heads_first(k, groups), _heads_first(v, groups)
    if q.device.type == "cpu" and not needs_grad:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qh, kh, vh, 0.0, causal, scale=scale
        )
        return out.transpose(1, 2), lse
    out = torch.nn.functional.scaled_dot_product_attention(
        qh, kh, vh, None, 0.0, causal, scale=scale
    )
    lse = torch.logsumexp(_scores(q, k, causal, scale, 0.0), dim=-1)
    return out.transpose(1, 2), lse


def sdpa_lse_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
    scale: float | None, softcap: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """The fused CPU flash backward (memory linear in the sequence) given the merged
    statistics; the math (:func:`eager_lse_backward`) on other devices."""
    import torch

    if q.device.type != "cpu" or softcap:
        return eager_lse_backward(dout, q, k, v, out, lse, causal, scale, softcap)
    groups = q.shape[2] // k.shape[2]
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout.to(q.dtype).transpose(1, 2), q.transpose(1, 2), _heads_first(k, groups),
        _heads_first(v, groups), out.to(q.dtype).transpose(1, 2), lse.to(_compute_dtype(q)),
        0.0, causal, scale=scale,
    )  # fmt: skip
    return dq.transpose(1, 2), _fold_heads(dk, groups), _fold_heads(dv, groups)


def make_fa_lse() -> LseKernelFn:
    """flash-attn 2's ``flash_attn_func(..., return_attn_probs=True)``: ``(out,
    softmax_lse, S_dmask)``, softmax_lse (batch, nheads, seqlen_q) float32
    (flash_attn/flash_attn_interface.py). Its causal mask is bottom-right aligned
    when the lengths differ; the ring only asks for causal blocks of equal
    lengths. A ring trains through :func:`make_fa_lse_backward` (recomputation),
    never through ``FlashAttnFunc.backward``, which takes no gradient for
    ``softmax_lse``.
    """
    from attnres.kernels.fa import BACKEND, INSTALL, PACKAGE  # only when it is built

    hint = "This is not flash-attn 2.x."
    func = kernel_function(PACKAGE, "flash_attn_func", backend=BACKEND, install=INSTALL, hint=hint)

    def fa_lse(
        q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float | None, softcap: float = 0.0,
        **options: Any,
    ) -> tuple[Tensor, Tensor]:  # fmt: skip
        # issue 23: the layer's options (deterministic) go to flash_attn_func as on
        # the dense route
        extra = {"softcap": softcap, **options} if softcap else options
        out, lse, _ = func(
            q, k, v, dropout_p=0.0, softmax_scale=scale, causal=causal, return_attn_probs=True,
            **extra,
        )  # fmt: skip
        return out, lse

    return fa_lse


def make_fa_lse_backward() -> LseBackwardFn:
    """flash-attn 2's ``flash_attn.flash_attn_interface._flash_attn_backward(dout, q, k,
    v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, ...)``, the entry
    point diffusers' and ring-flash-attention's rings call with the merged
    statistics. Its trailing parameters changed across 2.x (``window_size`` became
    ``window_size_left/right``; ``softcap``, ``alibi_slopes``, ``deterministic``,
    ``rng_state``), so they are passed by name where its signature has them, as
    ring-flash-attention does. GQA is native (dk, dv have the key/value heads).
    """
    import inspect

    from attnres.kernels.fa import BACKEND, INSTALL, PACKAGE  # only when it is built

    import_kernel_package(PACKAGE, backend=BACKEND, install=INSTALL)
    func = kernel_function(
        f"{PACKAGE}.flash_attn_interface", "_flash_attn_backward", backend=BACKEND,
        install=INSTALL, hint="This is not flash-attn 2.x.",
    )  # fmt: skip
    accepted = frozenset(inspect.signature(func).parameters)

    def fa_lse_backward(
        dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
        scale: float | None, softcap: float = 0.0, **options: Any,
    ) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        import torch

        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        given = {
            "dout": dout.to(q.dtype).contiguous(), "q": q.contiguous(), "k": k.contiguous(),
            "v": v.contiguous(), "out": out.to(q.dtype).contiguous(),
            "softmax_lse": lse.float().contiguous(), "dq": dq, "dk": dk, "dv": dv,
            "dropout_p": 0.0, "softmax_scale": q.shape[-1] ** -0.5 if scale is None else scale,
            "causal": causal, "window_size": (-1, -1), "window_size_left": -1,
            "window_size_right": -1, "softcap": softcap, "alibi_slopes": None,
            "deterministic": bool(options.get("deterministic", False)), "rng_state": None,
        }  # fmt: skip
        func(**{name: value for name, value in given.items() if name in accepted})
        return dq, dk, dv

    return fa_lse_backward


def make_sage_lse() -> LseKernelFn:
    """SageAttention 2's ``sageattn(q, k, v, tensor_layout="NHD", is_causal, sm_scale,
    return_lse=True)``: ``(out, lse)``, lse (batch, heads, seq_q), "used for cases like
    Ring Attention" (sageattention/core.py). ``is_causal`` is "only applicable when
    qo_len == kv_len": the ring only asks for causal blocks of equal lengths.
    Inference only (SageAttention has no backward pass); no softcap argument.
    SageAttention 1 (the registry's ``sageattention`` 1.0.6) has no ``return_lse``:
    its ``**kwargs`` swallow it and it returns ``out`` alone, which ``out, lse =``
    would split along the batch; that release is refused here (issue 31).
    """
    from attnres.kernels.sage_attn import BACKEND, INSTALL, PACKAGE, sage_function

    module = import_kernel_package(PACKAGE, backend=BACKEND, install=INSTALL)
    sageattn = require_attribute(module, "sageattn", backend=BACKEND, hint="Reinstall: " + INSTALL)
    if not takes_keywords(sageattn, "return_lse"):
        raise KernelUnavailableError(
            f"attention backend {BACKEND!r}: the installed {PACKAGE} has no return_lse "
            "(SageAttention 1, such as the registry's 1.0.6, returns the output alone), so "
            "it cannot serve a ring layout's log-sum-exp. Install SageAttention 2 from "
            "https://github.com/thu-ml/SageAttention, or run the ring on torch_sdpa",
            name=PACKAGE,
        )
    pick = sage_function(module)

    def sage_lse(
        q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float | None, softcap: float = 0.0,
        **options: Any,
    ) -> tuple[Tensor, Tensor]:  # fmt: skip
        if softcap:
            raise InvalidArgumentError("sage_attn has no softcap argument")
        # issue 23: with options, the device's own function (each takes return_lse)
        function, settings = pick(q, options)
        out, lse = function(
            q, k, v, tensor_layout="NHD", is_causal=causal, sm_scale=scale, return_lse=True,
            **settings,
        )  # fmt: skip
        return out, lse

    return sage_lse


#: backend -> a factory of its log-sum-exp adapter (built on first use)
_FACTORIES: dict[str, Callable[[], LseKernelFn]] = {
    "eager": lambda: eager_lse,
    "torch_sdpa": lambda: sdpa_lse,
    "fa": make_fa_lse,
    "sage_attn": make_sage_lse,
}
#: backend -> a factory of its block backward from the merged statistics (issue 35:
#: a ring trains on exactly these)
_BACKWARDS: dict[str, Callable[[], LseBackwardFn]] = {
    "eager": lambda: eager_lse_backward,
    "torch_sdpa": lambda: sdpa_lse_backward,
    "fa": make_fa_lse_backward,
}
#: the adapters built, for one registry generation (attnres._memo): a kernel
#: registered or ``clear_kernel_cache()`` builds them again
_BUILT: GenerationMemo[str, LseKernelFn] = GenerationMemo()
_BUILT_BACKWARDS: GenerationMemo[str, LseBackwardFn] = GenerationMemo()


def has_lse_kernel(backend_name: str) -> bool:
    """Whether attnres has a log-sum-exp adapter for ``backend_name`` (whether its
    package imports is the ``available`` check's business, as for any kernel)."""
    return backend_name in _FACTORIES


def lse_has_gradient(backend_name: str) -> bool:
    """Whether a ring can train on the adapter: attnres has its block backward from
    the merged log-sum-exp (:func:`get_lse_backward`)."""
    return backend_name in _BACKWARDS


def lse_kernel_names() -> tuple[str, ...]:
    """The backends with a log-sum-exp adapter, sorted."""
    return tuple(sorted(_FACTORIES))


_F = TypeVar("_F")


def _built(
    memo: GenerationMemo[str, _F], factories: Mapping[str, Callable[[], _F]], backend_name: str
) -> _F | None:
    """``backend_name``'s entry of ``memo``, built by its factory on first use (``None``:
    it has none)."""
    built = memo.get(backend_name)
    if built is None:
        factory = factories.get(backend_name)
        if factory is None:
            return None
        built = memo[backend_name] = factory()
    return built


def get_lse_kernel(backend_name: str) -> LseKernelFn | None:
    """The log-sum-exp adapter of ``backend_name`` (built on first use), or ``None``.

    A package that cannot be imported raises
    :class:`~attnres.kernels.KernelUnavailableError`, as :func:`attnres.kernels.get_kernel`.
    """
    return _built(_BUILT, _FACTORIES, backend_name)


def get_lse_backward(backend_name: str) -> LseBackwardFn | None:
    """The block backward of ``backend_name`` (built on first use), or ``None``: the
    ring is then inference-only on it."""
    return _built(_BUILT_BACKWARDS, _BACKWARDS, backend_name)


def clear_lse_cache() -> None:
    """Forget the built adapters (tests that swap a fake package in and out)."""
    _BUILT.clear()
    _BUILT_BACKWARDS.clear()
