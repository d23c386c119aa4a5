"""Issue 34: precision as a decision input -- facts, budgets, the precision check,
the SageAttention emulation, measured error with its evidence, and the done-when
scenario on a tiny FLUX pipeline."""

from __future__ import annotations

import json
import math
from pathlib import Path

import attrs
import pytest
import torch

import attnres
from attnres import backends as B
from attnres._states import Check, Code
from attnres.cli import main
from attnres.errors import ResultsFileError
from attnres.kernels.sage_emulated import SAGE_SCHEMES, sage_attention_emulated, scheme_for
from attnres.layer import (
    EXACT,
    LayerSpec,
    SelectionConfig,
    parse_attention_error,
    parse_error_budget,
)
from attnres.machine import PRECISION_RULES, check_candidate, layer_budget, run_machine
from attnres.platform import Platform
from attnres.precision import (
    calibrate,
    describe_precision,
    emulate_lossy_kernels,
    error_figures,
    load_calibration,
    precision_of_trace,
    reference_attention,
    save_calibration,
)
from attnres.records import ErrorMeasurement, PrecisionRecord
from attnres.scope import scope_state
from attnres.trace import TraceInput, load_trace, trace_from_json, trace_to_dict

ROOT = Path(__file__).resolve().parent.parent
HOPPER = "cuda:sm90+flash_attn+sageattention"
BUDGET = {"vae": "exact", "transformer": 2e-2}


def _input(component: str, budgets: dict[str, object] | None, **kw: object) -> TraceInput:
    cfg = SelectionConfig(global_backend="sage_attn", attention_error=budgets or {})
    return TraceInput(
        LayerSpec(head_size=128, dtype="bfloat16"),
        cfg,
        scope_state(component),
        Platform.simulate(HOPPER),
        **kw,  # type: ignore[arg-type]
    )


# =============================================================================
# 1. precision facts
# =============================================================================


def test_every_dense_builtin_states_its_precision_with_a_source() -> None:
    for spec in B.BUILTIN_SPECS:
        if spec.sparse:
            assert spec.precision == (), spec.name  # undeclared: an exact budget refuses them
            continue
        assert spec.precision, spec.name
        for fact in spec.precision:
            assert fact.source and fact.applies.kernel, spec.name
    lossy = {s.name for s in B.BUILTIN_SPECS if any(f.lossy for f in s.precision)}
    assert lossy == {"sage_attn", "sage_attn_3"}


@pytest.mark.parametrize(
    ("version", "capability", "kernel", "words"),
    [
        ("2.2.0", (8, 0), "SageAttention 2 on sm80", "P, V fp16"),
        ("2.2.0", (8, 6), "SageAttention 2 on sm86", "per-block scales"),
        ("2.2.0", (8, 9), "SageAttention 2 on sm89/sm120/sm121", "fp32+fp16"),
        ("2.2.0", (9, 0), "SageAttention 2 on sm90", "fp32+fp32"),
        ("2.2.0", (12, 0), "SageAttention 2 on sm89/sm120/sm121", "fp8 e4m3"),
        ("1.0.6", (9, 0), "SageAttention 1", "fp16 P.V accumulation"),
        ("2.2.0", None, "SageAttention 2 (GPU not known)", "int8"),
    ],
)
def test_sage_precision_differs_by_version_and_gpu(
    version: str, capability: tuple[int, int] | None, kernel: str, words: str
) -> None:
    fact = B.precision_of(B.get_spec("sage_attn"), "sageattention", version, "cuda", capability)
    assert fact is not None and fact.lossy
    assert fact.applies.kernel == kernel
    assert words in fact.describe()


def test_sage_attn_3_is_fp4_microscaling() -> None:
    (fact,) = B.get_spec("sage_attn_3").precision
    assert fact.lossy and "fp4" in fact.qk and "2505.11594" in fact.source


def test_backends_command_shows_precision(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["backends"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "precision on sm90: lossy: Q, K int8" in text
    assert "precision: exact: computes in the inputs' dtype" in text
    assert main(["backends", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    sage = next(b for b in doc["backends"] if b["name"] == "sage_attn")
    assert all(p["lossy"] for p in sage["precision"])


def _precision_block() -> str:
    out = [
        "| backend | applies to | kernel | exact or lossy | how | source |",
        "|---|---|---|---|---|---|",
    ]
    for spec in B.BUILTIN_SPECS:
        for fact in spec.precision:
            how = fact.describe().partition(": ")[2]
            out.append(
                f"| `{spec.name}` | {fact.applies.describe()} | {fact.applies.kernel} | "
                f"{fact.kind} | {how} | {fact.source} |"
            )
    return "\n".join(out)


def test_docs_show_the_precision_facts(update_golden: bool) -> None:
    from generated_docs import check_generated

    check_generated(
        ROOT / "docs" / "backends.md",
        "<!-- BEGIN generated: precision facts (tests/test_precision.py) -->",
        "<!-- END generated: precision facts -->",
        _precision_block(),
        update_golden,
    )


# =============================================================================
# 2. the budget: config, CLI, the machine's rule
# =============================================================================


def test_budget_parsing() -> None:
    assert parse_attention_error(["vae=exact,transformer=2e-2"]) == {
        "vae": "exact",
        "transformer": 0.02,
    }
    assert parse_attention_error(["2e-2"]) == {"*": 0.02}
    assert parse_attention_error(["Text-Encoder.cross=exact"]) == {"text_encoder.cross": "exact"}
    for bad in ("0", "-1", "2", "nan", "lossy", "vae=", "=exact"):
        with pytest.raises(ValueError):
            parse_attention_error([bad])
    with pytest.raises(ValueError, match="two budgets"):
        parse_attention_error(["vae=exact", "vae=0.1"])
    assert parse_error_budget("EXACT") == EXACT


def test_budget_lookup_order() -> None:
    cfg = SelectionConfig(
        attention_error={"*": 0.1, "text_encoder": "exact", "transformer.cross": "exact"}
    )
    self_, cross = attnres.Role.SELF, attnres.Role.CROSS
    assert cfg.error_budget("transformer", "transformer", cross) == ("transformer.cross", EXACT)
    assert cfg.error_budget("transformer", "transformer", self_) == ("*", 0.1)
    # text_encoder_2 is a text_encoder: the kind's key holds it
    assert cfg.error_budget("text_encoder_2", "text_encoder", self_) == ("text_encoder", EXACT)
    assert SelectionConfig().error_budget("vae", "vae", self_) is None


def test_no_budget_no_precision_check_and_same_trace() -> None:
    """No budget: no precision check, no record, schema as before (the golden
    corpus: byte-identical)."""
    inp = _input("vae", None)
    trace = run_machine(inp)
    assert all(getattr(r, "check", None) is not Check.PRECISION for r in trace.records)
    assert precision_of_trace(trace) is None and trace.schema_version < 6
    assert layer_budget(inp) is None and describe_precision(trace) == ""
    assert "attention_error" not in json.dumps(trace_to_dict(trace))


def test_exact_budget_rejects_lossy_by_facts_and_falls_back() -> None:
    trace = run_machine(_input("vae", BUDGET))
    assert trace.outcome.backend == "fa" and trace.outcome.reason == "global backend fallback"
    failures = [
        f
        for r in trace.records
        if getattr(r, "check", None) is Check.PRECISION
        for f in r.failures  # type: ignore[union-attr]
    ]
    assert [f.code for f in failures] == [Code.LOSSY_KERNEL]
    assert "--attention-error vae=exact" in failures[0].message
    record = precision_of_trace(trace)
    assert record is not None and record.precision == "exact" and record.budget == "exact"
    assert trace.schema_version == 6


def test_numeric_budget_admits_by_facts_then_measurement_decides() -> None:
    trace = run_machine(_input("transformer", BUDGET))
    assert trace.outcome.backend == "sage_attn"
    record = precision_of_trace(trace)
    assert record is not None and record.precision == "lossy" and record.measured is None
    within = ErrorMeasurement(attnres.Backend("sage_attn"), 0.01, 0.02, 0.9999, "q", True)
    ok = run_machine(_input("transformer", BUDGET, measured_error=(within,)))
    assert ok.outcome.backend == "sage_attn"
    assert precision_of_trace(ok).measured == within  # type: ignore[union-attr]
    over = attrs.evolve(within, rel_l2=0.05)
    bad = run_machine(_input("transformer", BUDGET, measured_error=(over,)))
    assert bad.outcome.status == "rejected" and bad.outcome.code == "error_over_budget"
    assert "relative L2 0.05" in (bad.outcome.error or "")


def test_undeclared_precision_fails_closed_under_exact() -> None:
    spec = attrs.evolve(B.get_spec("fa"), precision=())
    fails = attnres.machine._check_precision(  # type: ignore[attr-defined]
        spec, Platform.simulate(HOPPER), attnres.machine.Budget("vae", EXACT)
    )
    assert [f.code for f in fails] == [Code.LOSSY_KERNEL]
    assert "declares no precision facts" in fails[0].message


def test_precision_rules_name_their_codes() -> None:
    assert [c for c, _ in PRECISION_RULES] == [Code.LOSSY_KERNEL, Code.ERROR_OVER_BUDGET]


def test_check_candidate_without_budget_is_unchanged() -> None:
    layer = LayerSpec(head_size=128, dtype="bfloat16")
    checks = check_candidate(attnres.Backend("sage_attn"), layer, Platform.simulate(HOPPER))
    assert Check.PRECISION not in [c for c, _ in checks]


def test_trace_round_trip_and_older_version_refused() -> None:
    m = ErrorMeasurement(attnres.Backend("sage_attn"), 0.01, 0.02, 0.9999, "q", True, "loaded")
    trace = run_machine(_input("transformer", BUDGET, measured_error=(m,)))
    doc = trace_to_dict(trace)
    again = trace_from_json(json.dumps(doc))
    assert again == trace and attnres.replay(trace).ok
    doc["schema_version"] = 5
    with pytest.raises(attnres.TraceFormatError, match="schema version 6"):
        trace_from_json(json.dumps(doc))


def test_cli_explain_and_plan_show_precision(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    base = ["--platform", HOPPER, "--attention-backend", "sage_attn"]
    err = ["--attention-error", "vae=exact,transformer=2e-2"]
    assert main(["explain", "--head-size", "128", "--dtype", "bf16", "--component", "vae",
                 *base, *err]) == 0  # fmt: skip
    text = " ".join(capsys.readouterr().out.split())
    assert "Precision: exact, budget vae: exact" in text
    assert "precision FAIL is lossy (SageAttention 2 on sm90" in text
    pipeline = tmp_path / "p.toml"
    pipeline.write_text(
        '[pipeline]\nname = "tiny"\n[[components]]\nname = "transformer"\n'
        '[[components.layers]]\nname = "blocks.attn"\nhead_size = 128\ndtype = "bfloat16"\n'
        '[[components]]\nname = "vae"\n[[components.layers]]\nname = "mid.attn"\n'
        'head_size = 128\ndtype = "bfloat16"\n'
    )
    assert main(["plan", str(pipeline), *base, *err, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    layers = {c["name"]: c["layers"][0] for c in doc["components"]}
    assert layers["transformer"]["backend"] == "sage_attn"
    assert layers["transformer"]["precision"]["kind"] == "lossy"
    assert layers["vae"]["backend"] == "fa"
    assert layers["vae"]["precision"]["kind"] == "exact"
    assert main(["plan", str(pipeline), *base, "--json"]) == 0  # no budget: no key
    doc = json.loads(capsys.readouterr().out)
    assert all("precision" not in la for c in doc["components"] for la in c["layers"])


def test_cli_bad_budget_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["explain", "--head-size", "64", "--dtype", "bf16", "--attention-error", "3"])
    assert code == 2
    assert "relative L2 error must be in (0, 1]" in capsys.readouterr().err


# =============================================================================
# 3. the emulation, against the published algorithm and claims
# =============================================================================


def _qkv(n: int = 512, d: int = 64, heads: int = 4, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, n, heads, d, generator=g) for _ in range(3))


def test_emulation_is_exact_on_int8_and_fp8_representable_inputs() -> None:
    """The quantisation is the only error: inputs already on the int8 grid with
    one scale per group, V constant per channel, come back as exact attention."""
    q = torch.zeros(1, 64, 1, 64)
    k = torch.zeros(1, 64, 1, 64)
    v = torch.ones(1, 64, 1, 64) * 0.5
    out = sage_attention_emulated(q, k, v, capability=(9, 0))
    assert torch.allclose(out, torch.full_like(out, 0.5), atol=1e-6)


def test_emulation_error_ordering_matches_the_papers() -> None:
    """SageAttention papers: fp16 P.V (sm80/sm86) is more accurate than fp8 P.V
    (sm89/sm90), and every scheme keeps cosine similarity near 1 (~99.9%+)."""
    q, k, v = _qkv()
    ref = reference_attention(q, k, v)
    figures = {cap: error_figures(sage_attention_emulated(q, k, v, capability=cap), ref)
               for cap in SAGE_SCHEMES}  # fmt: skip
    assert figures[(8, 0)][0] < figures[(9, 0)][0]
    assert figures[(8, 6)][0] < figures[(8, 9)][0]
    for rel, _, cos in figures.values():
        assert 1e-4 < rel < 0.06 and cos > 0.998


def test_smoothing_k_removes_the_channel_outlier_error() -> None:
    """SageAttention (ICLR 2025) section 4.2: K has channel-wise outliers; subtracting
    its mean over tokens (softmax-invariant) restores int8 QK accuracy."""
    q, k, v = _qkv()
    k = k.clone()
    k[..., 3] += 20.0  # a channel-wise outlier shared by every token
    ref = reference_attention(q, k, v)
    smooth = error_figures(sage_attention_emulated(q, k, v, capability=(8, 6)), ref)[0]
    raw = error_figures(sage_attention_emulated(q, k, v, capability=(8, 6), smooth_k=False), ref)[0]
    assert smooth < raw / 3


def test_emulation_scheme_per_gpu_follows_core_py() -> None:
    assert scheme_for((9, 0)).function == "sageattn_qk_int8_pv_fp8_cuda_sm90"
    assert scheme_for((9, 0)).warpq == 16 and scheme_for((9, 0)).blkk == 128
    assert scheme_for((8, 9)).v_scale_max == 2.25  # fp32+fp16: scale_max 2.25
    assert scheme_for((8, 6)).gran == "per_block"
    with pytest.raises(ValueError, match="no attention mask"):
        q, k, v = _qkv(16)
        sage_attention_emulated(q, k, v, torch.ones(16, 16, dtype=torch.bool))


def test_emulation_registered_for_a_simulated_platform_only() -> None:
    with (
        pytest.raises(ValueError, match="simulated platform only"),
        emulate_lossy_kernels(Platform.detect()),
    ):
        pass
    platform = Platform.simulate(HOPPER)
    with emulate_lossy_kernels(platform):
        layer = attnres.Attention(4, 64, backend="sage_attn", dtype=torch.bfloat16,
                                  platform=platform)  # fmt: skip
        q, k, v = (t.bfloat16() for t in _qkv(128))
        out = layer(q, k, v)
    ref = reference_attention(q, k, v)
    rel, _, cos = error_figures(out, ref)
    assert 1e-3 < rel < 0.06 and cos > 0.998
    assert attnres.kernels.kernel_source("sage_attn") is not attnres.kernels.KernelSource.REGISTERED


# =============================================================================
# 4. measured error with evidence
# =============================================================================


def test_error_figures() -> None:
    ref = torch.tensor([1.0, 0.0, 0.0])
    assert error_figures(ref, ref) == (0.0, 0.0, 1.0)
    rel, mx, cos = error_figures(torch.tensor([1.0, 0.1, 0.0]), ref)
    assert math.isclose(rel, 0.1, rel_tol=1e-6) and math.isclose(mx, 0.1, rel_tol=1e-6) and cos < 1
    assert error_figures(torch.tensor([math.nan, 0, 0]), ref) == (math.inf, math.inf, 0.0)


class _Blocks(torch.nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.attn = torch.nn.ModuleList(attnres.Attention(4, 32) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for a in self.attn:
            x = a(x, x, x)
        return x


def test_calibrate_measures_each_layer_time_and_error() -> None:
    model = _Blocks(3)
    x = torch.randn(1, 16, 4, 32)
    report = calibrate(model, x)
    assert len(report.sites) == 3
    for site in report.sites:
        assert site.median_ns is not None and site.median_ns > 0
        assert site.measured is not None and site.measured.rel_l2 < 1e-5  # torch_sdpa: exact
        assert site.precision == "exact"
    timed = calibrate(model, x, errors=False)
    assert all(s.measured is None and s.median_ns for s in timed.sites)


def test_calibration_results_file_round_trip(tmp_path: Path) -> None:
    report = calibrate(_Blocks(2), torch.randn(1, 16, 4, 32))
    path = save_calibration(report, tmp_path / "cal.json")
    loaded = load_calibration(path)
    assert len(loaded) == 2
    for site in report.sites:
        m = loaded[(site.component, site.site)]
        assert m.source == "loaded" and m.rel_l2 == site.measured.rel_l2  # type: ignore[union-attr]
    doc = json.loads(path.read_text())
    assert all("median_ns" in e and "rel_l2" in e for e in doc["entries"])
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ResultsFileError, match="not a calibration results file"):
        load_calibration(tmp_path / "bad.json")
    with pytest.raises(ResultsFileError, match="cannot read the calibration results"):
        load_calibration(tmp_path / "missing.json")  # an attnres error, not the OS's


# =============================================================================
# 6. golden traces
# =============================================================================


@pytest.mark.parametrize(
    ("name", "status", "code"),
    [
        ("precision-vae-exact-budget-global-sage-falls-back-to-fa", "selected", None),
        ("precision-vae-override-sage-rejected-lossy-kernel", "rejected", "lossy_kernel"),
        ("precision-transformer-sage-admitted-with-measurement", "selected", None),
        ("precision-transformer-sage-over-budget-rejected", "rejected", "error_over_budget"),
        ("precision-transformer-sage-admitted-from-results-file", "selected", None),
    ],
)
def test_precision_golden_traces(name: str, status: str, code: str | None) -> None:
    trace = load_trace(ROOT / "traces" / f"{name}.json")
    assert trace.outcome.status == status and trace.outcome.code == code
    assert attnres.replay(trace).ok
    if (status == "selected" and "measurement" in name) or "results-file" in name:
        record = precision_of_trace(trace)
        assert isinstance(record, PrecisionRecord) and record.measured is not None
        assert record.measured.source == ("loaded" if "results-file" in name else "measured")


# =============================================================================
# 7. done when: a tiny FLUX pipeline on a simulated Hopper
# =============================================================================


def test_done_when_tiny_flux_on_simulated_hopper(tmp_path: Path) -> None:
    """Global sage_attn, --attention-error vae=exact,transformer=2e-2, simulated
    Hopper: the plan and the calibration report say which sites run the emulated
    Sage and how far each moved; the VAE stays exact, reasons in the traces."""
    from tiny_pipelines import flux, run_flux

    from attnres.integrations import diffusers as attnres_diffusers
    from attnres.precision import calibrate_pipeline

    pipe = flux(dtype=torch.bfloat16, vae_dtype=torch.bfloat16)
    platform = Platform.simulate(HOPPER)
    config = SelectionConfig(global_backend="sage_attn", attention_error=BUDGET)
    plan = attnres_diffusers.plan(pipe, config, platform)
    by_site = {(s.component, s.name): s for s in plan.sites if s.resolution is not None}
    for (component, _), site in by_site.items():
        trace = site.resolution.trace  # type: ignore[union-attr]
        if component == "vae":
            assert site.resolution.backend != "sage_attn"  # type: ignore[union-attr]
            assert precision_of_trace(trace).precision == "exact"  # type: ignore[union-attr]
            assert any(
                f.code == Code.LOSSY_KERNEL
                for r in trace.records
                for f in getattr(r, "failures", ())
            )
        if component == "transformer":
            assert site.resolution.backend == "sage_attn"  # type: ignore[union-attr]
            assert "lossy, budget transformer: rel L2 <= 0.02" in describe_precision(trace)
    report = calibrate_pipeline(pipe, run_flux, config, platform)
    lines = "\n".join(report.render())
    dit = [s for s in report.sites if s.component == "transformer"]
    vae = [s for s in report.sites if s.component == "vae"]
    assert dit and vae
    for s in dit:  # the emulated Sage, how far it moved, admitted within 2e-2
        assert s.measured is not None and s.measured.emulated
        assert 0 < s.measured.rel_l2 <= 0.02 and s.backend == "sage_attn"
        record = precision_of_trace(s.trace)  # type: ignore[arg-type]
        assert record is not None and record.measured == s.measured
    for s in vae:
        assert s.backend is not None and s.backend != "sage_attn" and s.precision == "exact"
    assert "transformer/transformer_blocks.0.attn: sage_attn [lossy" in lines
    assert "(emulated, measured)" in lines
    # the figures replay from a results file
    path = save_calibration(report, tmp_path / "flux.json")
    again = calibrate_pipeline(pipe, run_flux, config, platform, results=load_calibration(path))
    for a, b in zip(report.sites, again.sites, strict=True):
        assert a.backend == b.backend
        if a.measured is not None:
            assert b.measured is not None and b.measured.source == "loaded"
            assert b.measured.rel_l2 == a.measured.rel_l2


def test_cli_calibrate_measures_saves_and_replays(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    pipeline = tmp_path / "p.toml"
    pipeline.write_text(
        '[pipeline]\nname = "tiny"\n[[components]]\nname = "transformer"\n'
        '[[components.layers]]\nname = "blocks.attn"\nhead_size = 64\ndtype = "bfloat16"\n'
        '[[components]]\nname = "vae"\n[[components.layers]]\nname = "mid.attn"\n'
        'head_size = 64\ndtype = "bfloat16"\n'
    )
    base = [str(pipeline), "--platform", HOPPER, "--attention-backend", "sage_attn",
            "--tokens", "256", "--heads", "2"]  # fmt: skip
    saved = tmp_path / "cal.json"
    traces = tmp_path / "traces"
    code = main(["calibrate", *base, "--attention-error", "vae=exact,transformer=2e-2",
                 "--save", str(saved), "--trace-out", str(traces), "--json"])  # fmt: skip
    doc = json.loads(capsys.readouterr().out)
    sites = {s["component"]: s for s in doc["sites"]}
    rel = sites["transformer"]["measured"]["rel_l2"]
    assert sites["transformer"]["measured"]["emulated"] and 1e-3 < rel < 0.06
    assert sites["vae"]["precision"] == "exact" and sites["vae"]["measured"] is None
    # strict for the transformer: over the budget it is rejected, within it admitted
    assert code == (1 if rel > 0.02 else 0)
    assert (sites["transformer"]["backend"] is None) == (rel > 0.02)
    written = {p.name: load_trace(p) for p in traces.glob("*.json")}
    dit = written["transformer--blocks.attn.json"]
    assert dit.input.measured_error and attnres.replay(dit).ok
    # the results file replays: loaded figures, a looser budget admits
    code = main(["calibrate", *base, "--attention-error", "transformer=0.1",
                 "--load", str(saved)])  # fmt: skip
    out = " ".join(capsys.readouterr().out.split())
    assert code == 0 and f"rel L2 {rel:.3g}" in out and "(emulated, loaded)" in out


def test_pipeline_file_gives_component_budgets(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A pipeline file's ``attention_error`` per component; --attention-error wins per key."""
    pipeline = tmp_path / "p.toml"
    pipeline.write_text(
        '[pipeline]\nname = "tiny"\n[[components]]\nname = "transformer"\n'
        "attention_error = 2e-2\n"
        '[[components.layers]]\nname = "blocks.attn"\nhead_size = 128\ndtype = "bfloat16"\n'
        '[[components]]\nname = "vae"\nattention_error = "exact"\n'
        '[[components.layers]]\nname = "mid.attn"\nhead_size = 128\ndtype = "bfloat16"\n'
    )
    base = [str(pipeline), "--platform", HOPPER, "--attention-backend", "sage_attn", "--json"]
    assert main(["plan", *base]) == 0
    layers = {c["name"]: c["layers"][0] for c in json.loads(capsys.readouterr().out)["components"]}
    assert layers["vae"]["backend"] == "fa"
    assert layers["vae"]["precision"]["budget_key"] == "vae"
    assert layers["transformer"]["precision"]["budget"] == "rel L2 <= 0.02"
    assert main(["plan", *base, "--attention-error", "vae=0.5"]) == 0  # the flag wins
    layers = {c["name"]: c["layers"][0] for c in json.loads(capsys.readouterr().out)["components"]}
    assert layers["vae"]["backend"] == "sage_attn"
    bad = tmp_path / "bad.toml"
    bad.write_text(pipeline.read_text().replace('"exact"', '"lossless"'))
    assert main(["plan", str(bad)]) == 2
    assert "expected 'exact' or a relative L2 error" in capsys.readouterr().err
