"""The one place attnres reads torch's private module-call state (a speed shortcut).

``nn.Module.__call__`` costs about a microsecond before it reaches ``forward``
(two Python frames, ``*args`` re-packing, eight hook lookups): 5% of a
(1, 16, 8, 64) SDPA call on CPU. :class:`FastCallModule.__call__` runs
``forward``'s work directly when ``nn.Module.__call__`` would do nothing else --
no hooks on the module, no global module hooks, not compiled with
``Module.compile()``, not being traced by ``torch.jit`` -- and is
``nn.Module.__call__`` in every other case.

What it reads from torch (``torch/nn/modules/module.py``): the four global hook
registries (module-level dicts torch mutates in place, never rebinds), the
module's own hook dicts, ``_compiled_call_impl``, and
``torch._C._get_tracing_state``. :func:`torch_call_path_problems` checks that
all of them are still there; ``tests/test_modules.py`` fails loudly when a torch
release changes them (and checks that a globally registered forward hook still
fires). On a torch without the global registries the stand-ins below are never
empty, so every call takes ``nn.Module.__call__``: slower, never wrong.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

import torch
import torch.nn.modules.module as _nn_module
from torch import Tensor, nn

__all__ = ["FastCallModule", "torch_call_path_problems"]

_ALWAYS_SLOW: Final[dict[Any, Any]] = {"torch without global hook registries": True}
_REGISTRIES: Final = (
    "_global_backward_pre_hooks",
    "_global_backward_hooks",
    "_global_forward_pre_hooks",
    "_global_forward_hooks",
)
_G_BWD_PRE: dict[Any, Any] = getattr(_nn_module, _REGISTRIES[0], _ALWAYS_SLOW)
_G_BWD: dict[Any, Any] = getattr(_nn_module, _REGISTRIES[1], _ALWAYS_SLOW)
_G_FWD_PRE: dict[Any, Any] = getattr(_nn_module, _REGISTRIES[2], _ALWAYS_SLOW)
_G_FWD: dict[Any, Any] = getattr(_nn_module, _REGISTRIES[3], _ALWAYS_SLOW)
_tracing_state: Callable[[], Any] = getattr(torch._C, "_get_tracing_state", lambda: True)
_module_call = nn.Module.__call__


def torch_call_path_problems() -> list[str]:
    """What the shortcut relies on that this torch no longer has (empty: all there)."""
    problems = [
        f"torch.nn.modules.module.{name} is missing or not a dict"
        for name in _REGISTRIES
        if not isinstance(getattr(_nn_module, name, None), dict)
    ]
    if not hasattr(torch._C, "_get_tracing_state"):
        problems.append("torch._C._get_tracing_state is missing")
    probe = nn.Module()
    for attr in (
        "_forward_hooks",
        "_forward_pre_hooks",
        "_backward_hooks",
        "_backward_pre_hooks",
        "_compiled_call_impl",
    ):
        if not hasattr(probe, attr):
            problems.append(f"nn.Module instances have no {attr}")
    return problems


class FastCallModule(nn.Module):
    """An ``nn.Module`` whose ``__call__`` goes straight to ``self._run`` when it can.

    The base of attnres's attention layers (:class:`attnres.Attention`); the
    autotuner finds the layers of a model by it.

    Subclasses set ``_run(q, k, v, attn_mask) -> Tensor`` (the whole forward).
    """

    _run: Callable[..., Tensor]

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None) -> Tensor:
        # explicit parameters, not *args/**kwargs: no tuple/dict packing per call
        if (
            self._forward_hooks
            or self._forward_pre_hooks
            or self._backward_hooks
            or self._backward_pre_hooks
            or self._compiled_call_impl is not None
            or _G_BWD_PRE
            or _G_BWD
            or _G_FWD_PRE
            or _G_FWD
            or _tracing_state()
        ):
            out: Tensor = _module_call(self, q, k, v, attn_mask)
            return out
        return self._run(q, k, v, attn_mask)
