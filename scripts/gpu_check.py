"""``make gpu-check``: what to run the first time a CUDA GPU is available (issue 31).

On a machine with a CUDA GPU it runs, for every dense backend whose kernel package
is installed and whose catalogue facts (for the installed version and this GPU,
``Platform.installed``) admit the device:

- the forward pass against a float64 reference (plain, causal, GQA where claimed);
- the backward pass against the float64 reference's gradients, where claimed;
- the varlen entry point on packed tokens, where the spec has one;
- the log-sum-exp adapter, where the spec names one;
- each declared option, at every value it takes (forward);
- the key-padding masks route (gather, varlen kernel, scatter) against the same
  varlen kernel on already packed tokens (cost per call);
- the generic route's per-call cost: ``attnres.Attention`` against its kernel
  called directly;
- with two or more GPUs: NCCL consensus (``attnres.verify_consensus``) and
  sequence-parallel forwards (Ulysses and ring over 2 ranks) against one rank;
  with one GPU these are skipped with a note.

It writes one report, JSON (``--out``, default ``gpu-check-report.json``) with a
short text summary beside it (``.txt``), and stays under ``--budget`` seconds
(default 270: checks not started by then are listed as skipped). Without a CUDA
GPU it prints what it would run and exits 0, writing nothing.

Usage: ``python scripts/gpu_check.py [--out PATH] [--budget SECONDS] [--dry-run]``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from attnres._files import atomic_write_text, read_json

# tolerances against the float64 reference, by dtype (max abs error / max abs value)
_TOL = {"float16": 2e-2, "bfloat16": 4e-2, "float32": 2e-3, "float64": 1e-9}
#: SageAttention quantises Q and K to int8 (and 3 to fp4): a looser bound
_QUANTISED = {"sage_attn": 8e-2, "sage_attn_3": 2e-1}
_SHAPE = (2, 256, 8, 128)  # batch, seq, heads, head size
_TIMED_CALLS = 20
#: where the checks run (the suite runs a few on "cpu" to keep this script honest)
_DEVICE = "cuda"


def _what_would_run(specs: list[Any]) -> list[str]:
    """One line per check, for a machine whose GPU and packages are not known."""
    lines = []
    for spec in specs:
        parts = ["forward (plain, causal" + (", gqa" if "gqa" in _impl(spec) else "") + ")"]
        if "backward" in _impl(spec):
            parts.append("backward")
        if spec.varlen_kernel:
            parts.append("varlen")
        if spec.lse:
            parts.append("lse")
        if spec.options:
            parts.append("options " + ", ".join(o.name for o in spec.options))
        if any(m.route.value == "unpad" for m in spec.masks):
            parts.append("key-padding gather route vs packed tokens (cost)")
        if spec.refuses:
            parts.append("call-time refusals (a key/value length of 1, deterministic mode): "
                         "torch's own error, the adapter's KernelRefusedError")  # fmt: skip
        package = f" (needs package {spec.package})" if spec.package else ""
        lines.append(f"{spec.name}{package}: " + "; ".join(parts) + " -- vs float64")
    lines.append("generic route: attnres.Attention per-call cost vs its kernel called directly")
    lines.append(
        "NCCL (2+ GPUs): verify_consensus across ranks; SequenceParallel ulysses=2 and "
        "ring=2 forward vs one rank (skipped with a note on 1 GPU)"
    )
    return lines


def _impl(spec: Any) -> set[str]:
    return {r.value for r in spec.implements}


def _dense_specs() -> list[Any]:
    from attnres.backends import registered_backends

    return [
        s
        for s in registered_backends()
        if not s.sparse and s.kernel is not None and "cuda" in s.platforms
    ]


def _reference(q: Any, k: Any, v: Any, causal: bool, scale: float | None = None) -> Any:
    """float64 attention over (batch, seq, heads, head) with GQA; top-left causal."""
    import torch

    q64, k64, v64 = (t.double().transpose(1, 2) for t in (q, k, v))
    groups = q64.shape[1] // k64.shape[1]
    if groups > 1:
        k64, v64 = (t.repeat_interleave(groups, dim=1) for t in (k64, v64))
    s = (q64 @ k64.transpose(-1, -2)) * (scale if scale else q.shape[-1] ** -0.5)
    if causal:
        mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~mask, float("-inf"))
    return (s.softmax(-1) @ v64).transpose(1, 2), torch.logsumexp(s, dim=-1)


def _error(out: Any, ref: Any) -> float:
    ref = ref.double()
    return float((out.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-12))


def _timed(fn: Callable[[], Any]) -> float:
    import torch

    sync = torch.cuda.synchronize if _DEVICE == "cuda" else (lambda: None)
    fn()
    sync()
    start = time.perf_counter()
    for _ in range(_TIMED_CALLS):
        fn()
    sync()
    return (time.perf_counter() - start) / _TIMED_CALLS * 1e6  # microseconds


class _Report:
    def __init__(self, budget: float) -> None:
        self.deadline = time.monotonic() + budget
        self.checks: list[dict[str, Any]] = []

    def run(self, backend: str, name: str, fn: Callable[[], dict[str, Any]]) -> None:
        if time.monotonic() > self.deadline:
            self.checks.append({"backend": backend, "check": name, "status": "skipped",
                                "note": "time budget spent"})  # fmt: skip
            return
        start = time.perf_counter()
        try:
            result = fn()
            status = result.pop("status", "pass")
        except Exception as exc:  # every failure is the report's finding
            result = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0][:500],
                      "where": traceback.format_exc(limit=3)[-800:]}  # fmt: skip
            status = "error"
        result.update(backend=backend, check=name, status=status,
                      seconds=round(time.perf_counter() - start, 3))  # fmt: skip
        self.checks.append(result)


def _verdict(err: float, tol: float) -> dict[str, Any]:
    return {"status": "pass" if err <= tol else "fail", "max_rel_error": err, "tolerance": tol}


def _check_backend(report: _Report, spec: Any, platform: Any) -> None:
    import torch

    from attnres._varlen import get_varlen_kernel, route_kernel
    from attnres._vocab import MaskKind
    from attnres.kernels import get_kernel
    from attnres.kernels.lse import get_lse_kernel

    name = spec.name
    dtype_name = "bfloat16" if "bfloat16" in spec.dtypes else sorted(spec.dtypes)[0]
    dtype = getattr(torch, dtype_name)
    tol = _QUANTISED.get(name, _TOL[dtype_name])
    batch, seq, heads, head = _SHAPE
    if spec.head_sizes.failures(head):
        head = next(h for h in (64, 128, 96, 80, 256) if not spec.head_sizes.failures(h))
    gen = torch.Generator(device=_DEVICE).manual_seed(0)

    def tensors(kv_heads: int = heads, grad: bool = False) -> tuple[Any, Any, Any]:
        shapes = ((batch, seq, heads, head), *((batch, seq, kv_heads, head),) * 2)
        return tuple(  # type: ignore[return-value]
            torch.randn(s, generator=gen, device=_DEVICE, dtype=dtype).requires_grad_(grad)
            for s in shapes
        )

    kernel = get_kernel(name)
    if kernel is None:
        report.run(name, "forward", lambda: {"status": "skipped", "note": "no adapter"})
        return

    def forward(causal: bool, kv_heads: int = heads) -> dict[str, Any]:
        q, k, v = tensors(kv_heads)
        with torch.no_grad():
            out = kernel(q, k, v, None, causal, None)
        return _verdict(_error(out, _reference(q, k, v, causal)[0]), tol)

    report.run(name, "forward", lambda: forward(False))
    report.run(name, "forward causal", lambda: forward(True))
    if "gqa" in _impl(spec):
        report.run(name, "forward gqa", lambda: forward(False, heads // 2))
    needs_bwd = any("backward" in {r.value for r in lim.requirements} and
                    lim.applies({r for r in spec.implements}, platform.kind, platform.capability)
                    for lim in spec.limits)  # fmt: skip
    if "backward" in _impl(spec) and not needs_bwd:

        def backward() -> dict[str, Any]:
            q, k, v = tensors(grad=True)
            out = kernel(q, k, v, None, True, None)
            grad = torch.randn_like(out)
            out.backward(grad)
            q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
            _reference(q64, k64, v64, True)[0].backward(grad.double())
            errs = [_error(a.grad, b.grad) for a, b in ((q, q64), (k, k64), (v, v64))]
            return _verdict(max(errs), tol * 2) | {"grad_errors": errs}

        report.run(name, "backward", backward)
    if spec.varlen_kernel:

        def varlen() -> dict[str, Any]:
            fn = get_varlen_kernel(spec)
            lens = [seq, seq // 2, seq // 4 + 3]
            cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                              device=_DEVICE)  # fmt: skip
            total = sum(lens)
            q, k, v = (torch.randn(total, heads, head, generator=gen, device=_DEVICE, dtype=dtype)
                       for _ in range(3))  # fmt: skip
            with torch.no_grad():
                out = fn(q, k, v, cu, cu, max(lens), max(lens), True, None)
            errs = []
            for i in range(len(lens)):
                a, b = int(cu[i]), int(cu[i + 1])
                ref = _reference(*(t[a:b][None] for t in (q, k, v)), True)[0][0]
                errs.append(_error(out[a:b], ref))
            return _verdict(max(errs), tol)

        report.run(name, "varlen", varlen)
    if spec.lse:

        def lse() -> dict[str, Any]:
            fn = get_lse_kernel(name)
            if fn is None:
                return {"status": "skipped", "note": "the catalogue names an lse, attnres "
                        "has no lse adapter"}  # fmt: skip
            q, k, v = tensors()
            with torch.no_grad():
                out, got = fn(q, k, v, True, None)
            ref_out, ref_lse = _reference(q, k, v, True)
            # (batch, heads_q, seq_q), attnres.kernels.lse
            lse_err = float((got.double() - ref_lse).abs().max())
            return _verdict(max(_error(out, ref_out), lse_err / 10), tol) | {
                "lse_abs_error": lse_err
            }

        report.run(name, "lse", lse)
    entry = next((e for e in spec.entry_points if e.serves(platform.capability, False)), None)
    for declared in spec.options:
        # a dispatching kernel (SageAttention 2) takes each option per GPU function
        option = declared if not spec.entry_points else entry and entry.option(declared.name)
        if not option:
            report.run(name, f"option {declared.name}", lambda: {
                "status": "skipped", "note": "not taken by this GPU's function"})  # fmt: skip
            continue
        values = option.choices or ((True, False) if option.kind == "bool" else ())
        for value in values:

            def with_option(o: str = option.name, val: Any = value) -> dict[str, Any]:
                q, k, v = tensors()
                with torch.no_grad():
                    out = kernel(q, k, v, None, False, None, **{o: val})
                return _verdict(_error(out, _reference(q, k, v, False)[0]), tol)

            report.run(name, f"option {option.name}={value!r}", with_option)
    if any(m.kind is MaskKind.KEY_PADDING and m.route.value == "unpad" for m in spec.masks):

        def gather_cost() -> dict[str, Any]:
            routed = route_kernel(spec, kernel, MaskKind.KEY_PADDING)
            fn = get_varlen_kernel(spec)
            q, k, v = tensors()
            valid = torch.ones(batch, seq, dtype=torch.bool, device=_DEVICE)
            valid[1, seq // 2 :] = False
            mask = valid[:, None, None, :]
            lens = valid.sum(1).tolist()
            cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                              device=_DEVICE)  # fmt: skip
            packed = [t[valid] for t in (q, k, v)]
            with torch.no_grad():
                out = routed(q, k, v, mask, False, None)
                ref = torch.cat([_reference(*(t[i:i + 1, : lens[i]] for t in (q, k, v)),
                                            False)[0][0] for i in range(batch)])  # fmt: skip
                err = _error(out[valid], ref)
                routed_us = _timed(lambda: routed(q, k, v, mask, False, None))
                packed_us = _timed(lambda: fn(*packed, cu, cu, max(lens), max(lens), False, None))
            return _verdict(err, tol) | {"gather_route_us": routed_us, "packed_us": packed_us,
                                          "overhead_us": routed_us - packed_us}  # fmt: skip

        report.run(name, "key-padding gather route cost", gather_cost)
    if spec.refuses and name == "torch_cudnn_sdpa":
        report.run(name, "call-time refusals", lambda: _cudnn_refusals(kernel, tensors))


def _cudnn_refusals(kernel: Any, tensors: Callable[..., Any]) -> dict[str, Any]:
    """Issue 31: what BackendSpec.refuses states for cuDNN SDPA, on this torch and
    cuDNN: SDPA restricted to cuDNN raises for a key/value length of 1 and in
    deterministic mode, and the adapter raises KernelRefusedError first."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from attnres.errors import KernelRefusedError

    q, k, v = tensors()
    k1, v1 = k[:, :1].contiguous(), v[:, :1].contiguous()
    found: dict[str, Any] = {}

    def torch_refuses(key: Any, value: Any) -> bool:
        try:
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]), torch.no_grad():
                torch.nn.functional.scaled_dot_product_attention(
                    *(t.transpose(1, 2) for t in (q, key, value)))  # fmt: skip
        except RuntimeError:
            return True
        return False

    def adapter_refuses(key: Any, value: Any) -> bool:
        try:
            with torch.no_grad():
                kernel(q, key, value, None, False, None)
        except KernelRefusedError:
            return True
        return False

    found["seq_kv_1"] = {"torch": torch_refuses(k1, v1), "adapter": adapter_refuses(k1, v1)}
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        found["deterministic"] = {"torch": torch_refuses(k, v), "adapter": adapter_refuses(k, v)}
    finally:
        torch.use_deterministic_algorithms(before)
    held = all(all(case.values()) for case in found.values())
    # "fail": torch took what the catalogue says cuDNN refuses (a stale fact here)
    return {"status": "pass" if held else "fail", **found}


def _generic_route_cost(report: _Report) -> None:
    import torch

    import attnres
    from attnres.kernels import get_kernel

    def cost() -> dict[str, Any]:
        batch, seq, heads, head = 1, 128, 8, 64
        layer = attnres.Attention(heads, head, dtype="bfloat16", name="gpu_check.generic")
        kernel = get_kernel(layer.backend.name)
        q, k, v = (torch.randn(batch, seq, heads, head, device=_DEVICE, dtype=torch.bfloat16)
                   for _ in range(3))  # fmt: skip
        with torch.no_grad():
            layer_us = _timed(lambda: layer(q, k, v))
            direct_us = (_timed(lambda: kernel(q, k, v, None, False, None))
                         if kernel is not None else math.nan)  # fmt: skip
        return {"backend": layer.backend.name, "layer_us": layer_us, "kernel_us": direct_us,
                "overhead_us": layer_us - direct_us}  # fmt: skip

    report.run("attnres", "generic route per-call cost", cost)


def _rank(rank: int, world: int, folder: str) -> None:
    """One NCCL rank: consensus, then Ulysses and ring forwards against one rank."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import attnres

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{folder}/rendezvous", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))  # fmt: skip
    out: dict[str, Any] = {}
    try:
        attnres.Attention(8, 64, dtype="bfloat16", name="gpu_check.consensus")
        out["consensus"] = str(attnres.verify_consensus(timeout=30))[:300]
    except Exception as exc:
        out["consensus_error"] = f"{type(exc).__name__}: {exc}"[:500]
    gen = torch.Generator(device=_DEVICE).manual_seed(0)
    q, k, v = (torch.randn(1, 512, 8, 64, generator=gen, device=_DEVICE, dtype=torch.bfloat16)
               for _ in range(3))  # fmt: skip
    ref = _reference(q, k, v, False)[0]
    for label, degrees in (("ulysses", {"ulysses": world}), ("ring", {"ring": world})):
        try:
            sp = attnres.SequenceParallel(**degrees, timeout=60)
            layer = attnres.Attention(8, 64, dtype="bfloat16", parallel=sp,
                                      name=f"gpu_check.{label}")  # fmt: skip
            with torch.no_grad():
                part = layer(*(sp.shard(t) for t in (q, k, v)))
            out[label] = _error(part, sp.shard(ref))
        except Exception as exc:
            out[f"{label}_error"] = f"{type(exc).__name__}: {exc}"[:500]
    atomic_write_text(Path(folder, f"rank{rank}.json"), json.dumps(out))
    dist.destroy_process_group()


def _distributed(report: _Report) -> None:
    import torch

    count = torch.cuda.device_count()
    if count < 2:
        report.run("attnres", "NCCL consensus and sequence parallel",
                   lambda: {"status": "skipped", "note": f"{count} GPU here: needs 2"})  # fmt: skip
        return

    def run() -> dict[str, Any]:
        import torch.multiprocessing as mp

        world = 2
        with tempfile.TemporaryDirectory() as folder:
            mp.spawn(_rank, args=(world, folder), nprocs=world, join=True)
            ranks = [read_json(Path(folder, f"rank{r}.json"), what="a rank's result")
                     for r in range(world)]  # fmt: skip
        errors = [r for r in ranks if any(key.endswith("_error") for key in r)]
        worst = max(r.get(key, 0.0) for r in ranks for key in ("ulysses", "ring"))
        status = "error" if errors else ("pass" if worst <= _TOL["bfloat16"] else "fail")
        return {"status": status, "ranks": ranks, "max_rel_error": worst}

    report.run("attnres", "NCCL consensus and sequence parallel (2 ranks)", run)


def _summary(doc: dict[str, Any]) -> str:
    lines = [f"attnres gpu-check on {doc['device']} ({doc['seconds']:.0f} s)"]
    counts: dict[str, int] = {}
    for check in doc["checks"]:
        counts[check["status"]] = counts.get(check["status"], 0) + 1
    lines.append(", ".join(f"{n} {s}" for s, n in sorted(counts.items())))
    for check in doc["checks"]:
        if check["status"] != "pass":
            why = check.get("error") or check.get("note") or f"error {check.get('max_rel_error')}"
            lines.append(f"  {check['status']:7} {check['backend']}: {check['check']}: {why}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu-check-report.json", help="the JSON report")
    parser.add_argument("--budget", type=float, default=270.0, help="seconds (default 270)")
    parser.add_argument("--dry-run", action="store_true", help="print what would run")
    args = parser.parse_args(argv)
    started = time.monotonic()
    specs = _dense_specs()
    try:
        import torch

        has_gpu = bool(torch.cuda.is_available()) and not getattr(torch.version, "hip", None)
    except Exception as exc:  # no torch: nothing to run
        print(f"gpu-check: torch does not import ({type(exc).__name__}: {exc})")
        has_gpu = False
    if args.dry_run or not has_gpu:
        why = "--dry-run" if args.dry_run else "no CUDA GPU on this machine"
        print(f"gpu-check: {why}; on a CUDA GPU it would run, per installed backend "
              f"whose catalogue facts admit the device:")  # fmt: skip
        for line in _what_would_run(specs):
            print(f"  - {line}")
        print(f"and write {args.out} (JSON) and {Path(args.out).with_suffix('.txt')} (text), "
              f"within {args.budget:.0f} s.")  # fmt: skip
        return 0
    from attnres.platform import Platform

    platform = Platform.detect()
    report = _Report(args.budget)
    for base in specs:
        spec = platform.installed(base)[0]
        if spec.package is not None and not platform.package(spec.package).usable:
            continue
        rule = spec.capabilities.get("cuda")
        if "cuda" not in spec.platforms or (rule is not None and platform.capability is not None
                                            and not rule.fits(platform.capability)):  # fmt: skip
            continue
        _check_backend(report, spec, platform)
    _generic_route_cost(report)
    _distributed(report)
    doc = {
        "device": platform.describe(),
        "torch": platform.torch_version,
        "packages": {f.name: f.describe() for f in platform.packages if f.usable},
        "seconds": time.monotonic() - started,
        "checks": report.checks,
    }
    out = Path(args.out)
    atomic_write_text(out, json.dumps(doc, indent=2, default=str) + "\n")
    text = _summary(doc)
    atomic_write_text(out.with_suffix(".txt"), text)
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
