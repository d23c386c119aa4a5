"""Issue 14: the cost of governing a diffusers pipeline, measured in one run.

(a) a whole tiny-Flux pipeline call (CLIP + T5 + Flux DiT + AutoencoderKL, two
    steps) after ``attnres.integrations.diffusers.apply`` with no flag, paired
    with the same pipeline untouched: at most 1.02x;
(b) planning the full-size FLUX.1-dev folder (57 attention layers in the
    transformer, CLIP-L and T5-XXL) from its configs on the meta device,
    building the models included, cold resolution cache: under 2 s.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")
pytest.importorskip("transformers")

import attnres  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
import tiny_pipelines as tp  # noqa: E402

from attnres.integrations import diffusers as governed  # noqa: E402
from attnres.integrations import plan_folder  # noqa: E402

if TYPE_CHECKING:
    from conftest import RatioRegistry


def test_tiny_flux_forward_applied_vs_untouched(benchmark: Any, ratios: RatioRegistry,
                                                paired: Any) -> None:
    untouched = tp.flux()
    applied = tp.flux()
    governed.apply(applied)
    assert torch.equal(tp.run_flux(untouched), tp.run_flux(applied))
    untouched.set_progress_bar_config(disable=True)
    applied.set_progress_bar_config(disable=True)
    with torch.inference_mode():
        result = paired(lambda: tp.run_flux(applied), lambda: tp.run_flux(untouched),
                        rounds=40, inner=1)
    ratios.record("tiny Flux pipeline call, applied (no flag) / untouched", result.ratio,
                  target=1.02, note=result.describe())
    benchmark.extra_info["ratio_vs_untouched"] = result.ratio
    benchmark.pedantic(lambda: tp.run_flux(applied), rounds=10, iterations=1, warmup_rounds=1)


def test_plan_full_flux_on_meta(benchmark: Any, ratios: RatioRegistry) -> None:
    folder = ROOT / "examples" / "flux.1-dev"
    plan_folder(folder)  # imports and first-use costs out of the measurement
    times = []
    for _ in range(5):
        attnres.clear_cache()
        start = time.perf_counter()
        plan = plan_folder(folder)
        times.append(time.perf_counter() - start)
    assert len(plan.by_component()["transformer"]) == 57
    ratios.record("plan FLUX.1-dev folder on meta (cold cache)", statistics.median(times),
                  unit="s", target=2.0,
                  note=f"median of 5; min {min(times):.3f}s, max {max(times):.3f}s")
    benchmark.pedantic(lambda: plan_folder(folder), rounds=3, iterations=1)


def test_generic_route_vs_site_calling_the_kernel_itself(
    benchmark: Any, ratios: RatioRegistry, paired: Any
) -> None:
    """(c) the generic route on a tiny UNet attention block (``AttnProcessor2_0``
    decided ``eager``) against the same processor calling the same attnres kernel
    itself, with the same transposes: the route's per-call cost (the signature
    check and the kernel lookup) is the difference; at most 1.03x."""
    import copy

    from diffusers.models.attention_processor import Attention

    from attnres.integrations import _route
    from attnres.kernels import get_kernel

    torch.manual_seed(0)
    block = Attention(query_dim=64, heads=2, dim_head=32).eval()
    x = torch.randn(1, 256, 64)
    kernel = get_kernel("eager")
    assert kernel is not None

    class Itself:
        """The kernel called as the site would call it itself: no check, no lookup."""

        def __init__(self) -> None:
            self.homes: list[str] = []

        def __call__(self, q: Any, k: Any, v: Any, attn_mask: Any = None,
                     dropout_p: float = 0.0, is_causal: bool = False, scale: Any = None,
                     **_: Any) -> Any:
            out = kernel(q.transpose(-3, -2), k.transpose(-3, -2), v.transpose(-3, -2),
                         attn_mask, is_causal, scale)
            return out.transpose(-3, -2)

    itself = Itself()
    direct = copy.deepcopy(block)
    call = _route.rebind(type(block.processor).__call__, itself)  # type: ignore[arg-type]
    cls = type(block.processor)
    direct.set_processor(type(cls.__name__, (cls,), {"__call__": call})())
    routed = copy.deepcopy(block)
    holder = torch.nn.Module()
    holder.attn = routed
    plan = governed.apply({"vae": holder}, attnres.SelectionConfig(global_backend="eager"))
    assert {s.backend.name for s in plan.sites} == {"eager"}
    assert governed.routes({"vae": holder})
    with torch.inference_mode():
        torch.testing.assert_close(routed(x), direct(x))
        result = paired(lambda: routed(x), lambda: direct(x), rounds=60, inner=20)
    ratios.record("generic route / site calling the kernel itself (tiny UNet attention)",
                  result.ratio, target=1.03, note=result.describe())
    benchmark.extra_info["ratio_vs_direct"] = result.ratio
    benchmark.pedantic(lambda: routed(x), rounds=10, iterations=10, warmup_rounds=1)


def test_mha_route_vs_the_same_math_calling_the_kernel_itself(
    benchmark: Any, ratios: RatioRegistry, paired: Any
) -> None:
    """(d) issue 19: the MHA route on a ``torch.nn.MultiheadAttention`` decided
    ``eager`` (in-projection, heads split, kernel, out-projection) against the
    same math calling the same attnres kernel itself: the per-call signature
    check and kernel lookup are the difference; at most 1.03x."""
    from attnres.integrations import _route
    from attnres.kernels import get_kernel

    torch.manual_seed(0)
    holder = torch.nn.Module()
    holder.attn = torch.nn.MultiheadAttention(64, 2, batch_first=True).eval()
    mha = holder.attn
    x = torch.randn(1, 256, 64)
    kernel = get_kernel("eager")
    assert kernel is not None

    import copy

    direct = copy.deepcopy(mha)

    def math(query: Any, key: Any, value: Any, need_weights: bool = True) -> Any:
        """The same math as the route, with no check and no lookup (a module call too)."""
        q, k, v = _route._mha_projections(direct, query, key, value)
        n, s = q.shape[0], q.shape[1]
        out = kernel(q.view(n, s, 2, 32), k.view(n, s, 2, 32), v.view(n, s, 2, 32),
                     None, False, None).reshape(n, s, 64)
        return torch.nn.functional.linear(out, direct.out_proj.weight, direct.out_proj.bias), None

    direct.forward = math  # type: ignore[method-assign]
    plan = governed.apply({"vae": holder}, attnres.SelectionConfig(global_backend="eager"))
    assert {s.backend.name for s in plan.sites} == {"eager"}

    def routed() -> Any:
        return mha(x, x, x, need_weights=False)[0]

    def itself() -> Any:
        return direct(x, x, x, need_weights=False)[0]

    with torch.inference_mode():
        torch.testing.assert_close(routed(), itself())
        result = paired(routed, itself, rounds=60, inner=20)
    ratios.record("MHA route / the same math calling the kernel itself",
                  result.ratio, target=1.03, note=result.describe())
    benchmark.extra_info["ratio_vs_direct"] = result.ratio
    benchmark.pedantic(routed, rounds=10, iterations=10, warmup_rounds=1)


@pytest.mark.parametrize("seq", [256, 1024])
def test_a_by_hand_site_under_a_flag_runs_its_own_code_at_its_own_cost(
    benchmark: Any, ratios: RatioRegistry, paired: Any, seq: int
) -> None:
    """(e) issue 30: a transformers module computing softmax attention by hand
    (XGLM's attention: bmm, views, softmax, dropout, bmm) applied under a global
    ``torch_sdpa`` in a component that may fall back runs its own code (the
    reason ``softmax attention written by hand``): nothing is installed, so it
    costs what the untouched module does (1.00x, paired against a deep copy)."""
    import copy

    import transformers

    from attnres.integrations import transformers as itf

    torch.manual_seed(0)
    cfg = transformers.XGLMConfig(d_model=256, attention_heads=4, num_layers=1, ffn_dim=64,
                                  vocab_size=32, max_position_embeddings=512)  # fmt: skip
    model = transformers.XGLMModel(cfg).eval()
    attn = model.layers[0].self_attn
    x = torch.randn(1, seq, 256)
    plain = copy.deepcopy(attn)  # the module untouched
    with torch.inference_mode():
        plan = itf.apply(model, "text_encoder",
                         attnres.SelectionConfig(global_backend="torch_sdpa"))  # fmt: skip
        assert {s.backend.name for s in plan.sites} == {"eager"}
        assert "forward" not in attn.__dict__  # nothing installed
        assert torch.equal(attn(x)[0], plain(x)[0])
        result = paired(lambda: attn(x)[0], lambda: plain(x)[0], rounds=40, inner=5)
        ratios.record(f"by-hand site under a flag (its own code) / untouched ({seq} tokens)",
                      result.ratio, note=result.describe())  # fmt: skip
        benchmark.extra_info["ratio_vs_untouched"] = result.ratio
        benchmark.pedantic(lambda: attn(x)[0], rounds=10, iterations=5, warmup_rounds=1)
    itf.remove(model)
