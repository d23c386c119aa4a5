"""attnres.explain: explanations built from traces, as data, used by text and JSON."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from attnres._states import Reason, State
from attnres.backends import Backend
from attnres.cli import main
from attnres.explain import explain
from attnres.trace import load_trace

ROOT = Path(__file__).resolve().parent.parent
SEED = ROOT / "traces" / "audio-vae-global-sage-falls-back-to-default.json"


def test_explanation_of_the_seed_incident_is_structured() -> None:
    trace = load_trace(SEED)  # a loaded trace explains like a fresh one
    why = explain(trace)
    assert why.outcome.reason is Reason.GLOBAL_BACKEND_FALLBACK
    assert why.requested == Backend("sage_attn")
    assert why.accepted_stage is State.COMPONENT_DEFAULT
    assert why.relaxation is not None and why.relaxation.relaxed
    assert why.relaxation.scope is not None and why.relaxation.scope.component == "audio_vae"
    assert why.fallback_failures.startswith("sage_attn: ")
    assert "The flag is relaxed here (the layer declares default 'torch_sdpa'" in why.why
    kinds = [row.kind for row in why.rows]
    assert kinds[0] == "transition" and why.rows[0].detail == "request_found: to requested"
    first = why.rows[1]
    assert first.kind == "check"
    assert (first.stage, first.candidate) == (State.REQUESTED, Backend("sage_attn"))
    assert why.to_dict()["accepted_stage"] == "component_default"


def test_text_and_json_output_come_from_the_same_explanation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    args = ["explain", "--head-size", "128", "--dtype", "bf16", "--supported", "fa,torch_sdpa",
            "--default", "torch_sdpa", "--component", "audio_vae",
            "--attention-backend", "sage_attn", "--platform", "cuda:sm90+all"]  # fmt: skip
    outputs = []
    for extra in ([], ["--json"]):
        out = io.StringIO()
        monkeypatch.setattr("sys.stdout", out)
        assert main([*args, *extra]) == 0
        outputs.append(out.getvalue())
    text, doc = outputs[0], json.loads(outputs[1])
    why = doc["explanation"]["why"]
    assert why.startswith("the operator's --attention-backend sage_attn cannot serve")
    flattened = " ".join(text.split())
    assert " ".join(why.split()) in flattened
    assert doc["explanation"]["requested"] == "sage_attn"


def test_describe_layer_names_an_exact_route_only_when_set() -> None:
    from attnres import LayerSpec
    from attnres.explain import describe_layer

    route = "transformers attention interface"
    plain = LayerSpec(64, "bf16", supported={"torch_sdpa"})
    exact = LayerSpec(64, "bf16", supported={"torch_sdpa"}, exact_route=route)
    assert "route" not in describe_layer(plain)
    assert f"supported: torch_sdpa (exactly, by its route: {route});" in describe_layer(exact)
