"""Golden traces of integration plans: traces/integrations/.

- ``tiny-flux-global-sage/``: the done-when scenario (a tiny Flux, DiT and
  text encoders in bf16, VAE in float32, a global ``sage_attn`` on a simulated
  ``cuda:sm90+flash_attn+sageattention``), one trace per row of like sites;
- ``first-call/``: a generic-route site (SD3's ``JointAttnProcessor2_0`` calls
  SDPA itself and gets sage), a site decided at its first call (a module that
  holds no head facts) and a site re-resolved at its first call (a call with
  dropout, which the plan did not describe, falls back from flex attention to
  the site's own SDPA); an own code path made a routed site (issue 19: a
  ``torch.nn.MultiheadAttention`` gets sage; an MHA call that returns its
  weights falls back to its own path); softmax attention written by hand, which
  runs its own code (issue 30): diffusers' ``AttnProcessor`` and Bloom's
  attention keep it under a global sage where the component may fall back (the
  reason ``softmax attention written by hand``) and a strict sage is rejected;
  a module holding no head facts (a VQ-VAE attention block) is decided at its
  first call from its scores product: eager with no flag, a strict sage
  rejected on its route.

Each file replays clean, and planning again gives exactly these traces.
``pytest tests/test_integrations_golden.py --update-golden`` (``make golden``)
rewrites them.
"""

from __future__ import annotations

import copy
from pathlib import Path

# The dev extra installs diffusers (make test): a missing one is an import
# error here, never a silently skipped module.
import diffusers  # noqa: F401
import pytest
import tiny_pipelines as tp
import torch
import transformers

from attnres import Backend, Platform, SelectionConfig
from attnres.errors import ResolutionError
from attnres.integrations import _route
from attnres.integrations import diffusers as idf
from attnres.integrations import transformers as itf
from attnres.replayer import replay
from attnres.scope import scope_state
from attnres.trace import canonical_json, dump_trace, load_trace, trace_to_dict

ROOT = Path(__file__).resolve().parent.parent / "traces" / "integrations"
FOLDER = ROOT / "tiny-flux-global-sage"
FIRST_CALL = ROOT / "first-call"
SIM = "cuda:sm90+flash_attn+sageattention"


@pytest.fixture(scope="module")
def planned():
    pipe = tp.flux(dtype=torch.bfloat16, vae_dtype=torch.float32)
    return idf.plan(pipe, SelectionConfig(global_backend="sage_attn"), Platform.simulate(SIM))


def _sync(folder: Path, written: list[Path], update: bool) -> None:
    if update:
        folder.mkdir(parents=True, exist_ok=True)
        names = {p.name for p in written}
        for old in folder.glob("*.json"):
            if old.name not in names:
                old.unlink()
        for path in written:
            target = folder / path.name
            text = path.read_text(encoding="utf-8")
            if not target.exists() or target.read_text(encoding="utf-8") != text:
                target.write_text(text, encoding="utf-8")
    assert sorted(p.name for p in folder.glob("*.json")) == sorted(p.name for p in written)
    for path in written:
        assert (folder / path.name).read_text(encoding="utf-8") == path.read_text(), path.name


def test_golden_tiny_flux_plan_matches_its_traces(planned, tmp_path, update_golden):
    fresh = tmp_path / "fresh"
    written = planned.dump_traces(fresh)
    _sync(FOLDER, written, update_golden)
    for layer in planned.layers:
        text = canonical_json(trace_to_dict(layer.trace))
        assert any(p.read_text() == text for p in written), layer.name


def test_golden_tiny_flux_traces_replay_clean():
    files = sorted(FOLDER.glob("*.json"))
    assert len(files) >= 6
    for path in files:
        result = replay(path)
        assert result.ok, result.diff


def test_golden_tiny_flux_traces_say_what_the_issue_says():
    for path in sorted(FOLDER.glob("*.json")):
        outcome = load_trace(path).outcome
        # issue 22: CLIP (text_encoder__) runs sage through attnres's transformers
        # function; T5 (text_encoder_2__) passes an additive mask and falls back
        if path.name.startswith(("transformer__", "text_encoder__")):
            assert (outcome.backend.name, outcome.reason) == ("sage_attn", None)
        else:
            assert (outcome.backend.name, outcome.reason) == (
                "torch_sdpa",
                "global backend fallback",
            )
            if path.name.startswith("text_encoder_2__"):
                assert "does not implement additive masks" in path.read_text(encoding="utf-8")


def _first_call_traces(tmp_path: Path) -> list[Path]:
    written: list[Path] = []
    # a generic-route site: SD3's joint processor calls SDPA itself
    sd3 = copy.deepcopy(tp.sd3()["transformer"]).to(torch.bfloat16)
    plan = idf.plan(
        {"transformer": sd3}, SelectionConfig(global_backend="sage_attn"), Platform.simulate(SIM)
    )
    site = plan.sites[0]
    assert site.routed and site.backend.name == "sage_attn"
    path = tmp_path / "generic-route-sd3-joint-processor-global-sage-selected.json"
    dump_trace(site.trace, path)
    written.append(path)
    cpu = Platform.simulate("cpu")
    q = torch.randn(1, 2, 5, 16)
    # a site decided at its first call: no head facts until q, k, v arrive
    route = _route.GenericRoute(
        component="vae",
        name="block",
        spec=None,
        heads=None,
        kv_heads=None,
        resolution=None,
        config=SelectionConfig(),
        scope=scope_state("vae"),
        platform=cpu,
    )
    route(q, q, q)
    (first,) = route.first_calls
    assert first.changed == ("head facts (decided at first call)",)
    path = tmp_path / "decided-at-first-call-vae-block-torch-sdpa.json"
    dump_trace(first.trace, path)
    written.append(path)
    # a site re-resolved at its first call: a dropout the plan did not describe
    flex = SelectionConfig(global_backend="flex_attention")
    plan = idf.plan({"vae": tp.unet()}, flex, cpu)
    site = plan.sites[0]
    assert site.backend.name == "flex_attention"
    route = _route.GenericRoute(
        component="vae",
        name=site.name,
        spec=site.spec,
        heads=site.heads,
        kv_heads=site.kv_heads,
        resolution=site.resolution,
        config=flex,
        scope=scope_state("vae"),
        platform=cpu,
    )
    route(q, q, q, dropout_p=0.5)
    (first,) = route.first_calls
    assert first.changed == ("dropout",) and first.backend.name == "torch_sdpa"
    path = tmp_path / "re-resolved-at-first-call-dropout-flex-falls-back-to-torch-sdpa.json"
    dump_trace(first.trace, path)
    written.append(path)
    written += _own_path_traces(tmp_path)
    return written


class _Holder(torch.nn.Module):
    def __init__(self, attn: torch.nn.Module) -> None:
        super().__init__()
        self.attn = attn


def _own_path_traces(tmp_path: Path) -> list[Path]:
    """Issue 19: an own code path made a routed site (MHA's own math) under a global
    sage, and an MHA call that returns its weights, re-resolved at its first call
    to its own path. Issue 30: diffusers' by-hand ``AttnProcessor`` runs its own
    code: a global sage falls back where the component may, and a strict one is
    rejected on its route."""
    from diffusers.models.attention_processor import Attention, AttnProcessor

    written: list[Path] = []
    sage = SelectionConfig(global_backend="sage_attn")
    model = _Holder(torch.nn.MultiheadAttention(128, 2)).eval().to(torch.bfloat16)
    (site,) = idf.plan({"transformer": model}, sage, Platform.simulate(SIM)).sites
    assert site.routed and site.backend.name == "sage_attn"
    path = tmp_path / "generic-route-mha-own-math-global-sage-selected.json"
    dump_trace(site.trace, path)
    written.append(path)
    attn = Attention(128, heads=2, dim_head=64, processor=AttnProcessor())
    model = _Holder(attn).eval().to(torch.bfloat16)
    for component, stem in (("vae", "falls-back"), ("transformer", "strict-rejected")):
        (site,) = idf.plan({component: model}, sage, Platform.simulate(SIM)).sites
        assert site.by_hand and site.trace is not None
        if site.resolution is not None:
            assert str(site.resolution.reason) == "softmax attention written by hand"
        path = tmp_path / f"own-code-by-hand-attn-processor-global-sage-{stem}.json"
        dump_trace(site.trace, path)
        written.append(path)
    cpu = Platform.simulate("cpu")
    flex = SelectionConfig(global_backend="flex_attention")
    model = _Holder(torch.nn.MultiheadAttention(64, 4, batch_first=True)).eval()
    (site,) = idf.plan({"vae": model}, flex, cpu).sites
    assert site.backend.name == "flex_attention"
    route = _route.site_route(site, flex, cpu)
    x = torch.randn(2, 5, 64)
    _route.mha_forward(model.attn, route)(x, x, x)  # need_weights=True: torch's default
    (first,) = route.first_calls
    assert first.changed == ("attention weights returned (need_weights=True)",)
    assert first.backend.name == "eager"
    path = tmp_path / "re-resolved-at-first-call-mha-need-weights-falls-back-to-eager.json"
    dump_trace(first.trace, path)
    written.append(path)
    written += _by_hand_first_call_traces(tmp_path)
    return written


def _by_hand_first_call_traces(tmp_path: Path) -> list[Path]:
    """Issue 30: softmax by hand in a module holding no head facts (a VQ-VAE
    attention block: one head over its channels) is decided at its first call,
    its head facts read from its scores product (its own code runs it, nothing
    else): with no flag its own code (eager), under a strict global sage rejected
    on its route; and Bloom's by-hand attention (its ALiBi bias) keeps its own
    code under a global sage in a component that may fall back, saying why."""
    from transformers.models.janus.modeling_janus import JanusVQVAEAttnBlock

    torch.manual_seed(0)
    block = JanusVQVAEAttnBlock(32).eval().to(torch.bfloat16)
    written: list[Path] = []
    own_route = _route.by_hand_route("JanusVQVAEAttnBlock")
    for stem, config in (
        ("no-flag-eager", SelectionConfig()),
        ("strict-sage-rejected", SelectionConfig(global_backend="sage_attn")),
    ):
        route = _route.GenericRoute(
            component="transformer", name="vq.attn", spec=None, heads=None, kv_heads=None,
            resolution=None, config=config, scope=scope_state("transformer"),
            platform=Platform.simulate(SIM), own=Backend("eager"), own_route=own_route,
        )  # fmt: skip
        with torch.no_grad():
            forward = _route.watch_forward(block, route)
            if config.global_backend is None:
                forward(torch.randn(1, 32, 4, 4, dtype=torch.bfloat16))
            else:
                with pytest.raises(ResolutionError, match="written by hand"):
                    forward(torch.randn(1, 32, 4, 4, dtype=torch.bfloat16))
        (first,) = route.first_calls
        assert first.changed == ("head facts (decided at first call)",)
        assert (first.facts.heads, first.facts.head_size) == (1, 32)
        assert (first.backend is None) == (config.global_backend is not None)
        path = tmp_path / f"decided-at-first-call-by-hand-vq-block-{stem}.json"
        dump_trace(first.trace, path)
        written.append(path)
    bloom = transformers.BloomModel(
        transformers.BloomConfig(hidden_size=32, n_head=2, n_layer=1, vocab_size=32)
    )
    bloom = bloom.eval().to(torch.bfloat16)
    sage = SelectionConfig(global_backend="sage_attn")
    plan = itf.plan(bloom, "text_encoder", sage, Platform.simulate(SIM))
    (site,) = plan.sites
    assert site.by_hand and site.backend.name == "eager"
    assert str(site.resolution.reason) == "softmax attention written by hand"
    path = tmp_path / "own-code-by-hand-bloom-global-sage-falls-back.json"
    dump_trace(site.trace, path)
    written.append(path)
    return written


def test_golden_first_call_traces(tmp_path, update_golden, varlen_fakes):
    written = _first_call_traces(tmp_path)
    _sync(FIRST_CALL, written, update_golden)
    for path in sorted(FIRST_CALL.glob("*.json")):
        result = replay(path)
        assert result.ok, result.diff
    outcome = load_trace(FIRST_CALL / written[2].name).outcome
    assert (outcome.backend.name, outcome.reason) == ("torch_sdpa", "global backend fallback")
