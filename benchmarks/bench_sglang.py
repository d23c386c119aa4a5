"""A decision through the SGLang plugin vs SGLang's own ``get_attn_backend`` (issue 23).

Target: at most 1.5x SGLang's own selector for the same request, cold (SGLang's
platform cache and attnres's resolution cache both cleared before every call)
and cached (the same call repeated). Paired, side by side in one run. Cold
means every cache of both sides is cleared before each call: SGLang's
platform cache, attnres's resolution cache and the plugin's memo of decided
calls (the plugin then traces the decision and emits its audit event).

Needs SGLang: ``make bench-sglang`` runs this file in the ``make test-sglang``
environment. Under ``make bench`` (no SGLang) the rows are recorded as skipped
with the reason.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from conftest import PairedResult, RatioRegistry



def have_sglang() -> bool:
    """Whether the SGLang distribution is importable. A folder named ``sglang``
    on the path without an ``__init__`` (this repository's ``tests/sglang``,
    which pytest puts there) is a namespace package, not SGLang: its spec has
    no origin (issue 32 item 19)."""
    spec = importlib.util.find_spec("sglang")
    return spec is not None and spec.origin not in (None, "namespace")


HAVE_SGLANG = have_sglang()
ROWS = ("sglang plugin vs get_attn_backend, cached", "sglang plugin vs get_attn_backend, cold")


def _selector() -> tuple[Any, Any, Any, tuple[Any, ...]]:
    """SGLang's selector, its own function, attnres's, and one layer's arguments."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "sglang"))
    import sglang_standins  # noqa: F401  (triton and torchvision stand-ins)
    import torch
    from sglang.multimodal_gen.runtime.layers.attention import selector
    from sglang.multimodal_gen.runtime.platforms import AttentionBackendEnum
    from sglang.multimodal_gen.runtime.server_args import set_global_server_args

    from attnres.integrations import sglang as plugin

    set_global_server_args(SimpleNamespace(attention_backend=None))
    plugin.uninstall()
    original = selector.get_attn_backend
    plugin.install()
    routed = selector.get_attn_backend
    supported = {AttentionBackendEnum.FA, AttentionBackendEnum.TORCH_SDPA}
    return selector, original, routed, (128, torch.bfloat16, supported)


def test_sglang_plugin_decision_cost(benchmark: Any, ratios: RatioRegistry, paired: Any) -> None:
    if not HAVE_SGLANG:
        for name in ROWS:
            ratios.record(name, None, note="SGLang not installed: run make bench-sglang")
        benchmark(lambda: None)
        return
    import attnres
    from attnres.integrations import sglang as plugin

    selector, original, routed, args = _selector()
    try:
        assert routed(*args) is original(*args)  # the same answer, or the ratio means nothing
        cached: PairedResult = paired(
            lambda: routed(*args), lambda: original(*args), rounds=40, inner=200
        )
        ratios.record(ROWS[0], cached.ratio, target=1.5, note=cached.describe())

        def cold_routed() -> object:
            selector._cached_get_attn_backend.cache_clear()
            attnres.clear_cache()
            plugin.clear_memo()
            return routed(*args)

        def cold_sglang() -> object:
            selector._cached_get_attn_backend.cache_clear()
            return original(*args)

        cold: PairedResult = paired(cold_routed, cold_sglang, rounds=30, inner=20)
        ratios.record(ROWS[1], cold.ratio, target=1.5, note=cold.describe())
        benchmark(lambda: routed(*args))
    finally:
        plugin.uninstall()
        attnres.clear_decisions()
