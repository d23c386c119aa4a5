"""Golden traces of one tiny pipeline's plan: traces/integrations/tiny-flux-global-sage/.

The done-when scenario (a tiny Flux, DiT and text encoders in bf16, VAE in
float32, a global ``sage_attn`` on a simulated ``cuda:sm90+flash_attn+
sageattention``) planned site by site; each file replays clean, and planning
the pipeline again gives exactly these traces. ``pytest
tests/test_integrations_golden.py --update-golden`` (``make golden``)
rewrites them.
"""

from __future__ import annotations

from pathlib import Path

# The dev extra installs diffusers (make test): a missing one is an import
# error here, never a silently skipped module.
import diffusers  # noqa: F401
import pytest
import tiny_pipelines as tp
import torch

from attnres import Platform, SelectionConfig
from attnres.integrations import diffusers as idf
from attnres.replayer import replay
from attnres.trace import canonical_json, trace_to_dict

FOLDER = Path(__file__).resolve().parent.parent / "traces" / "integrations" / \
    "tiny-flux-global-sage"


@pytest.fixture(scope="module")
def planned():
    pipe = tp.flux(dtype=torch.bfloat16, vae_dtype=torch.float32)
    return idf.plan(pipe, SelectionConfig(global_backend="sage_attn"),
                    Platform.simulate("cuda:sm90+flash_attn+sageattention"))


def test_golden_tiny_flux_plan_matches_its_traces(planned, tmp_path, update_golden):
    fresh = tmp_path / "fresh"
    written = planned.dump_traces(fresh)
    if update_golden:
        FOLDER.mkdir(parents=True, exist_ok=True)
        for old in FOLDER.glob("*.json"):
            if not (fresh / old.name).exists():
                old.unlink()
        for path in written:
            target = FOLDER / path.name
            text = path.read_text(encoding="utf-8")
            if not target.exists() or target.read_text(encoding="utf-8") != text:
                target.write_text(text, encoding="utf-8")
    assert sorted(p.name for p in FOLDER.glob("*.json")) == sorted(p.name for p in written)
    for site in planned.sites:
        files = [p for p in written if p.read_text() == canonical_json(
            trace_to_dict(site.trace))]
        assert files, site.name
        assert (FOLDER / files[0].name).read_text(encoding="utf-8") == files[0].read_text()


def test_golden_tiny_flux_traces_replay_clean():
    files = sorted(FOLDER.glob("*.json"))
    assert len(files) >= 8
    for path in files:
        result = replay(path)
        assert result.ok, result.diff


def test_golden_tiny_flux_traces_say_what_the_issue_says():
    from attnres.trace import load_trace

    for path in sorted(FOLDER.glob("*.json")):
        trace = load_trace(path)
        outcome = trace.outcome
        # issue 22: CLIP (text_encoder__) runs sage through attnres's transformers
        # function; T5 (text_encoder_2__) passes an additive mask and falls back
        if path.name.startswith(("transformer__", "text_encoder__")):
            assert (outcome.backend.name, outcome.reason) == ("sage_attn", None)
        else:
            assert (outcome.backend.name, outcome.reason) == (
                "torch_sdpa", "global backend fallback")
            if path.name.startswith("text_encoder_2__"):
                assert "does not implement additive masks" in path.read_text(encoding="utf-8")
