"""The ledger (``attnres.ledger``): one entry per layer, typed like every record."""

from __future__ import annotations

import attrs
import torch

import attnres
from attnres import Attention, Backend, Platform

CPU = Platform.simulate("cpu")


def test_decision_backend_is_a_backend_equal_to_the_resolutions() -> None:
    attnres.clear_decisions()
    layer = Attention(2, 16, dtype=torch.float32, platform=CPU, name="typed")
    decision = attnres.decisions()[-1]
    assert isinstance(decision.backend, Backend)
    assert decision.backend == layer.resolution.backend  # type: ignore[union-attr]
    assert decision.backend == "torch_sdpa"  # and equal to its name, as a StrEnum member
    assert hash(decision.backend) == hash("torch_sdpa")
    assert f"{decision.backend:>12}" == "  torch_sdpa"


def test_a_cast_keeps_one_entry_per_layer_the_current_decision() -> None:
    attnres.clear_decisions()
    layer = Attention(2, 16, dtype=torch.float32, platform=CPU, name="cast.me")
    layer.double()
    layer.float()
    entries = [d for d in attnres.decisions() if d.layer == "cast.me"]
    assert len(entries) == 1
    assert entries[0].trace is layer.resolution.trace  # type: ignore[union-attr]


def test_set_and_forget_keep_one_current_entry_per_site() -> None:
    # issue 33: an integration's apply replaces its sites' entries; remove forgets
    # them; neither counts as dropped by the bound
    from attnres import ledger

    attnres.clear_decisions()
    layer = Attention(2, 16, dtype=torch.float32, platform=CPU, name="kept")
    kept = attnres.decisions()[-1]
    first = attrs.evolve(kept, component="text_encoder", layer="layers.0.attn")
    second = attrs.evolve(kept, component="text_encoder", layer="layers.1.attn")
    ledger.set_decisions([first, second])
    ledger.set_decisions([second, first])  # applied again: replaced, not added
    assert [d.layer for d in attnres.decisions()] == ["kept", "layers.1.attn", "layers.0.attn"]
    assert ledger.forget_decisions([("text_encoder", "layers.0.attn")]) == 1
    assert attnres.decisions() == (kept, second)
    assert ledger.dropped_decisions() == 0
    assert layer.resolution is not None
