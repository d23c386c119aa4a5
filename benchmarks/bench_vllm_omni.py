"""A decision through the vLLM-Omni plugin vs vLLM-Omni's own ``get_attn_backend_for_role``
(issue 36).

Targets: the plugin's cached decision at most 1.0x vLLM-Omni's own cached
selector for the same call (the call an ``Attention`` layer makes, keyword
arguments and all), and a cold decision at most 100 us. Paired, side by side in
one run. Cached: the same call repeated (vLLM-Omni's caches warm; the plugin
answers from its memo, asks vLLM-Omni's own cache again, logs through
vLLM-Omni's own log cache and records the decision in ``attnres.decisions()``).
Cold: every decision cache of both sides cleared before each call: vLLM-Omni's
``_cached_get_backend_cls``, attnres's resolution cache and the plugin's memo
(the plugin then observes the platform, runs the machine, traces, audits and
records the decision). vLLM-Omni's log cache is kept on both sides: clearing it
would time its log handler writing a line, not a decision.

vLLM-Omni's platform is the one its own selection tests put in place
(``current_omni_platform`` replaced by an object whose
``get_diffusion_attn_backend_cls`` answers with the TORCH_SDPA class path), so
both sides load vLLM-Omni's real ``SDPABackend``.

Needs vLLM-Omni: ``make bench-vllm-omni`` runs this file in the ``make
test-vllm-omni`` environment. Under ``make bench`` (no vLLM-Omni) the rows are
recorded as skipped with the reason.
"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from conftest import PairedResult, RatioRegistry


def have_vllm_omni() -> bool:
    """Whether the vLLM-Omni distribution is importable (not a namespace folder)."""
    spec = importlib.util.find_spec("vllm_omni")
    return spec is not None and spec.origin not in (None, "namespace")


HAVE_VLLM_OMNI = have_vllm_omni()
ROWS = (
    "vllm-omni plugin vs get_attn_backend_for_role, cached",
    "vllm-omni plugin vs get_attn_backend_for_role, cold",
    "vllm-omni plugin, cold decision",
)


def _selector() -> tuple[Any, Any, Any, dict[str, Any], Any]:
    """vLLM-Omni's selector, its own function, attnres's, one layer's call, and the
    platform it replaced (restored afterwards)."""
    import vllm_omni.platforms as platforms
    from vllm_omni.diffusion.attention import selector
    from vllm_omni.diffusion.attention.backends.registry import DiffusionAttentionBackendEnum
    from vllm_omni.diffusion.data import AttentionConfig, AttentionSpec

    from attnres.integrations import vllm_omni as plugin

    sdpa = DiffusionAttentionBackendEnum.TORCH_SDPA
    sdpa.get_class()  # imported before the platform is replaced (it reads it at import)
    before = platforms.current_omni_platform
    platforms.current_omni_platform = SimpleNamespace(
        device_type="cuda",
        get_diffusion_attn_backend_cls=lambda **_: sdpa.get_path(),
    )
    plugin.uninstall()
    held = {
        "original": selector.get_attn_backend_for_role
    }  # not a module global: install rebinds those
    plugin.install()
    routed = selector.get_attn_backend_for_role
    config = AttentionConfig(default=AttentionSpec(backend="TORCH_SDPA"))
    call = {
        "role": "self",
        "head_size": 128,
        "attention_config": config,
        "role_category": None,
        "allow_trtllm_default": True,
    }
    return selector, held["original"], routed, call, before


def test_vllm_omni_plugin_decision_cost(benchmark: Any, ratios: RatioRegistry, paired: Any) -> None:
    if not HAVE_VLLM_OMNI:
        for name in ROWS:
            ratios.record(name, None, note="vLLM-Omni not installed: run make bench-vllm-omni")
        benchmark(lambda: None)
        return
    import vllm_omni.platforms as platforms

    import attnres
    from attnres.integrations import vllm_omni as plugin

    selector, original, routed, call, before = _selector()
    try:
        assert routed(**call) == original(**call)  # the same answer, or the ratio means nothing
        cached: PairedResult = paired(
            lambda: routed(**call), lambda: original(**call), rounds=40, inner=500
        )
        ratios.record(ROWS[0], cached.ratio, target=1.0, note=cached.describe())

        def cold_routed() -> object:
            selector._cached_get_backend_cls.cache_clear()
            attnres.clear_cache()
            plugin.clear_memo()
            return routed(**call)

        def cold_vllm_omni() -> object:
            selector._cached_get_backend_cls.cache_clear()
            return original(**call)

        cold: PairedResult = paired(cold_routed, cold_vllm_omni, rounds=30, inner=20)
        ratios.record(ROWS[1], cold.ratio, note=cold.describe())
        ratios.record(
            ROWS[2], cold.median_a_ns / 1e3, target=100.0, unit="µs", note=cold.describe()
        )
        benchmark(lambda: routed(**call))
    finally:
        plugin.uninstall()
        platforms.current_omni_platform = before
        attnres.clear_decisions()
