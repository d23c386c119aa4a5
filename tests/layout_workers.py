"""Worker processes for the issue-35 layouts (``tests/test_layouts.py``).

Like :mod:`parallel_workers`, each rank joins a gloo group through a ``file://``
rendezvous, runs a list of scenarios in order and writes ``result.<rank>.json``:

- ``kinds``: head-padded Ulysses, AllGather-KV (alone and inside Ulysses), key-padding
  masks under Ulysses and AllGather-KV, joint attention with replicated text tokens;
  float32 through the layer against a float64 one-process reference, forward and
  gradients (every rank compares: the shapes are tiny);
- ``auto``: a tiny DiT block built with ``SequenceParallel(layout="auto")``: the
  layout each layer's trace records (rule and why), its output and gradients
  against the block on one process in float64, and a measured interconnect;
- ``auto_disagree``: the ranks declare different interconnects, so they choose
  different layouts; the first forward must stop every rank with a ConsensusError.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from pathlib import Path
from typing import Any

from dist_workers import join_group

#: every collective's bound in these workers (seconds)
TIMEOUT_S = 8.0


def reference(q: Any, k: Any, v: Any, keep: Any = None) -> Any:
    """Non-causal attention in float64 on one process: (b, s, h, d), GQA, and a
    key-padding mask ``keep`` (b, s_kv) of booleans."""

    q64, k64, v64 = (t.double().transpose(1, 2) for t in (q, k, v))
    groups = q64.shape[1] // k64.shape[1]
    k64 = k64.repeat_interleave(groups, 1)
    v64 = v64.repeat_interleave(groups, 1)
    scores = (q64 @ k64.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if keep is not None:
        scores = scores.masked_fill(~keep[:, None, None, :], float("-inf"))
    return (scores.softmax(-1) @ v64).transpose(1, 2)


def _cases(world: int) -> list[dict[str, Any]]:
    """(layout, heads, kv heads, text tokens, mask) of the ``kinds`` scenario."""
    cases: list[dict[str, Any]] = [
        # head padding: 3 heads (2 ranks: to 4; 4 ranks: to 4), 6/3 GQA (to 8/4)
        {"sp": {"ulysses": world, "pad_heads": True}, "heads": 3, "kv": 3},
        {"sp": {"ulysses": world, "pad_heads": True}, "heads": 6, "kv": 3},
        # AllGather-KV, GQA and MHA
        {"sp": {"allgather": world}, "heads": 8, "kv": 2},
        {"sp": {"allgather": world}, "heads": 3, "kv": 3},
        # key-padding masks: Ulysses, AllGather-KV, padded Ulysses (boolean and 0/-inf)
        {"sp": {"ulysses": world}, "heads": 8, "kv": 4, "mask": "bool"},
        {"sp": {"allgather": world}, "heads": 4, "kv": 4, "mask": "float"},
        {"sp": {"ulysses": world, "pad_heads": True}, "heads": 3, "kv": 3, "mask": "bool"},
        # joint attention: replicated text tokens in front of each rank's shard
        {"sp": {"ulysses": world, "text_tokens": 3}, "heads": 4, "kv": 4},
        {"sp": {"allgather": world, "text_tokens": 3}, "heads": 4, "kv": 2, "mask": "bool"},
        {"sp": {"ulysses": world, "pad_heads": True, "text_tokens": 2}, "heads": 3, "kv": 3},
    ]
    if world == 4:  # the 2-D layouts: Ulysses inside AllGather-KV or a ring, padded
        cases += [
            {"sp": {"ulysses": 2, "allgather": 2}, "heads": 4, "kv": 2},
            {"sp": {"ulysses": 2, "allgather": 2, "text_tokens": 2}, "heads": 2, "kv": 2,
             "mask": "bool"},
            {"sp": {"ulysses": 2, "ring": 2, "pad_heads": True}, "heads": 3, "kv": 3},
        ]  # fmt: skip
    return cases


def _kinds(rank: int, world: int) -> dict[str, Any]:
    import torch

    import attnres

    results = []
    for index, case in enumerate(_cases(world)):
        options = dict(case["sp"])
        sp = attnres.SequenceParallel(timeout=TIMEOUT_S, **options)
        n = options.get("text_tokens", 0)
        heads, kv, d = case["heads"], case["kv"], 8
        mask = case.get("mask")
        layer = attnres.Attention(
            heads,
            d,
            num_kv_heads=kv,
            dtype="float32",
            parallel=sp,
            requirements=attnres.Requirements(mask="key_padding") if mask else None,
            name=f"kinds.{index}",
        )
        gen = torch.Generator().manual_seed(100 + index)
        length = 3 * world + 1  # uneven: the first rank holds one token more
        q, k, v = (torch.randn(2, length, h, d, generator=gen) for h in (heads, kv, kv))
        text = [torch.randn(2, n, h, d, generator=gen) for h in (heads, kv, kv)]
        keep_img = torch.rand(2, length, generator=gen) > 0.3
        keep_img[:, 0] = True  # every query sees a key
        keep_text = torch.ones(2, n, dtype=torch.bool)
        w_img = torch.randn(2, length, heads, d, generator=gen)
        w_text = torch.randn(world, 2, n, heads, d, generator=gen)  # each rank's own
        shards = [sp.shard(t).clone().requires_grad_() for t in (q, k, v)]
        texts = [t.clone().requires_grad_() for t in text]
        inputs = [torch.cat([tt, ts], 1) for tt, ts in zip(texts, shards, strict=True)]
        attn_mask = None
        if mask:
            keep = torch.cat([keep_text, sp.shard(keep_img)], 1)
            attn_mask = (
                keep
                if mask == "bool"
                else torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))[:, None, None, :]
            )
        out = layer(*inputs, attn_mask)
        loss = (out[:, n:] * sp.shard(w_img)).sum() + (out[:, :n] * w_text[rank]).sum()
        loss.backward()
        # the reference: text tokens then the whole image sequence, on one process
        full = [
            torch.cat([tt, t], 1).double().requires_grad_()
            for tt, t in zip(text, (q, k, v), strict=True)
        ]
        keep_full = torch.cat([keep_text, keep_img], 1) if mask else None
        expected = reference(*full, keep_full)
        (
            (expected[:, n:] * w_img.double()).sum()
            + (expected[:, :n] * w_text.sum(0).double()).sum()
        ).backward()
        got = torch.cat([out[:, :n].detach(), sp.gather(out[:, n:].detach())], 1)
        err = (got.double() - expected.detach()).abs().max().item()
        grad_err = 0.0
        for i in range(3):
            ref = full[i].grad
            assert ref is not None and shards[i].grad is not None
            grad_err = max(
                grad_err, (sp.gather(shards[i].grad).double() - ref[:, n:]).abs().max().item()
            )
            if n:
                assert texts[i].grad is not None
                grad_err = max(grad_err, (texts[i].grad.double() - ref[:, :n]).abs().max().item())
        resolution = layer.resolution
        assert resolution is not None
        layout = resolution.trace.input.layer.layout
        results.append(
            {
                "case": case,
                "err": err,
                "grad_err": grad_err,
                "backend": layer.backend.name,
                "layout": None if layout is None else layout.ulysses_ring(),
            }
        )
    return {"cases": results}


def _dit_block(parallel: Any) -> Any:
    """A tiny DiT block: self-attention (4 heads) and GQA cross-attention (8 heads, 2
    kv heads) to a text sequence."""
    from torch import nn

    import attnres

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            dim = 32
            self.qkv = nn.Linear(dim, 3 * dim)
            self.q2 = nn.Linear(dim, dim)
            self.kv2 = nn.Linear(dim, 16)  # 2 kv heads x 4 x (k, v)
            self.out1, self.out2 = nn.Linear(dim, dim), nn.Linear(dim, dim)
            common = {"dtype": "float32", "parallel": parallel}
            self.attn1 = attnres.Attention(4, 8, name="dit.attn1", **common)
            self.attn2 = attnres.Attention(
                8, 4, num_kv_heads=2, role="cross", name="dit.attn2", **common
            )

        def forward(self, x: Any, text: Any) -> Any:
            b, s, _ = x.shape
            q, k, v = self.qkv(x).reshape(b, s, 3, 4, 8).unbind(2)
            x = x + self.out1(self.attn1(q, k, v).reshape(b, s, -1))
            q = self.q2(x).reshape(b, s, 8, 4)
            k, v = self.kv2(text).reshape(b, text.shape[1], 2, 2, 4).unbind(2)
            return x + self.out2(self.attn2(q, k, v).reshape(b, s, -1))

    return Block()


def _auto(rank: int, world: int) -> dict[str, Any]:
    import torch

    import attnres

    out: dict[str, Any] = {}
    for name, options in (
        ("declared", {"interconnect": "nvlink", "seq_len": 6 * world + 1}),
        ("measured", {"interconnect": "measure"}),
    ):
        sp = attnres.SequenceParallel(layout="auto", timeout=TIMEOUT_S, **options)
        torch.manual_seed(0)
        single = _dit_block(None).double()
        block = _dit_block(sp)
        block.load_state_dict(single.state_dict())
        gen = torch.Generator().manual_seed(5)
        x = torch.randn(1, 6 * world + 1, 32, generator=gen)
        text = torch.randn(1, 2 * world + 1, 32, generator=gen)
        xs, ts = sp.shard(x).clone().requires_grad_(), sp.shard(text).clone().requires_grad_()
        got = block(xs, ts)
        weight = torch.randn(x.shape, generator=gen)
        (got * sp.shard(weight)).sum().backward()
        x64, t64 = x.double().requires_grad_(), text.double().requires_grad_()
        expected = single(x64, t64)
        (expected * weight.double()).sum().backward()
        assert xs.grad is not None and x64.grad is not None
        layers = {}
        for site, attn in (("attn1", block.attn1), ("attn2", block.attn2)):
            resolution = attn.resolution
            assert resolution is not None
            trace = resolution.trace
            layout = trace.input.layer.layout
            layers[site] = {
                "layout": layout.ulysses_ring(),
                "rule": layout.rule,
                "why": layout.why,
                "schema": trace.schema_version,
                "backend": attn.backend.name,
            }
        out[name] = {
            "err": (sp.gather(got.detach()).double() - expected.detach()).abs().max().item(),
            "grad_err": (sp.gather(xs.grad).double() - x64.grad).abs().max().item(),
            "layers": layers,
            "interconnect": [sp.interconnect, sp.interconnect_source],
        }
    return out


def _auto_disagree(rank: int, world: int) -> dict[str, Any]:
    import torch

    import attnres

    # rank 0 says NVLink (Ulysses), the others PCIe (a ring at 2 ranks)
    link = "nvlink" if rank == 0 else "pcie"
    sp = attnres.SequenceParallel(layout="auto", interconnect=link, timeout=TIMEOUT_S)
    layer = attnres.Attention(4, 8, dtype="float32", parallel=sp, name="disagree")
    q = torch.randn(1, 3, 4, 8)
    start = time.monotonic()
    try:
        layer(q, q, q)
    except attnres.ConsensusError as exc:
        return {"error": str(exc), "elapsed_s": time.monotonic() - start}
    return {"error": None}


def _write(path: Path, result: dict[str, Any]) -> None:
    if path.exists():
        result = {**json.loads(path.read_text()), **result}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, sort_keys=True, default=str))
    os.replace(tmp, path)


def worker(rank: int, world: int, tmpdir: str, scenarios: list[str]) -> None:
    import torch.distributed as dist

    directory = Path(tmpdir)
    join_group(rank, world, directory, timeout_s=60.0)
    path = directory / f"result.{rank}.json"
    _write(path, {})
    fns = {"kinds": _kinds, "auto": _auto, "auto_disagree": _auto_disagree}
    for scenario in scenarios:
        began = time.monotonic()
        try:
            result = fns[scenario](rank, world)
        except BaseException:  # reported, not raised: the test names it
            result = {"crashed": traceback.format_exc()}
        result["scenario_s"] = round(time.monotonic() - began, 2)
        _write(path, {scenario: result})
    dist.destroy_process_group()
