"""The golden scenarios: one table of resolutions that ``traces/`` pins.

Each :class:`Scenario` is the full input of one resolution (layer, selection
config, component-scope snapshot, platform facts, per-layer backend) plus the
outcome it is meant to show. ``make golden`` (``pytest tests/test_golden.py
--update-golden``) runs every scenario through the machine and writes
``traces/<name>.json``; ``tests/test_golden.py`` replays every file, checks
each scenario still does what its name says, and that files and scenarios
match one to one.

Together the scenarios cover every origin, every candidate stage (reached and
accepting), every reason, every rejection code a loadable trace can carry,
every platform kind, role overrides, backend aliases, requirements, broken
packages and the seed incident (a global ``--attention-backend sage_attn``
that must relax for auxiliary components and stay strict for the main model).

Scopes are given as the :class:`~attnres.scope.ScopeState` snapshot that
:func:`~attnres.scope.component_scope` would build (:func:`scope_state`), and
platforms as :meth:`~attnres.platform.Platform.simulate` strings or as
``Platform`` objects built directly (a broken package, an old torch).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path

import attrs
from attrs import field, frozen

from attnres._vocab import Role
from attnres.backends import Backend
from attnres.layer import LayerSpec, SelectionConfig
from attnres.layout import SequenceLayout
from attnres.machine import LayoutFacts, choose_layout, run_machine
from attnres.platform import HostResolution, PackageFact, Platform
from attnres.scope import ScopeState, scope_state
from attnres.trace import (
    ErrorMeasurement,
    Trace,
    TraceInput,
    atomic_write_text,
    canonical_json,
    trace_to_dict,
)

__all__ = [
    "SCENARIOS",
    "CorpusChange",
    "Expect",
    "Scenario",
    "corpus_status",
    "rejects",
    "scenario_by_name",
    "scope_state",
    "selects",
    "update_corpus",
]

#: A scenario name: lower-case words joined by '-' (it is also the file name).
NAME_RE = re.compile(r"[a-z0-9]+(?:-[a-z0-9]+)*")


# =============================================================================
# Building blocks
# =============================================================================


@frozen
class Expect:
    """What a scenario must produce: selected backend and reason, or a rejection code."""

    status: str
    origin: str
    backend: str | None = None
    reason: str | None = None
    code: str | None = None
    #: substrings the rejection message must contain
    error_contains: tuple[str, ...] = ()

    def describe(self) -> str:
        if self.status == "selected":
            why = f" ({self.reason})" if self.reason else ""
            return f"selected {self.backend}{why} via {self.origin}"
        return f"rejected ({self.code}) via {self.origin}"


def selects(backend: str, reason: str | None = None, *, origin: str) -> Expect:
    return Expect("selected", origin, backend=backend, reason=reason)


def rejects(code: str, *, origin: str, error_contains: Iterable[str] = ()) -> Expect:
    return Expect("rejected", origin, code=code, error_contains=tuple(error_contains))


def _platform(value: Platform | str) -> Platform:
    return value if isinstance(value, Platform) else Platform.simulate(value)


def _backend(value: Backend | str | None) -> Backend | None:
    return None if value is None else Backend.parse(value)


@frozen
class Scenario:
    """One golden resolution: its full input and the outcome its name promises."""

    name: str
    description: str
    layer: LayerSpec
    config: SelectionConfig
    scope: ScopeState | None
    platform: Platform = field(converter=_platform)
    backend: Backend | None = field(converter=_backend)
    expect: Expect = field(kw_only=True)
    #: the backend one request asked for (attnres.request_backend; origin request)
    request: Backend | None = field(default=None, converter=_backend, kw_only=True)
    #: resolved for a layer that will run (``attnres.Attention``)
    needs_kernel: bool = field(default=False, kw_only=True)
    #: issue 34: kernels' measured errors on the layer's inputs (calibrate, results files)
    measured_error: tuple[ErrorMeasurement, ...] = field(default=(), kw_only=True)

    @property
    def filename(self) -> str:
        return f"{self.name}.json"

    def input(self) -> TraceInput:
        return TraceInput(
            self.layer,
            self.config,
            self.scope,
            self.platform,
            self.backend,
            self.request,
            needs_kernel=self.needs_kernel,
            measured_error=self.measured_error,
        )

    def run(self) -> Trace:
        return run_machine(self.input())

    def render(self) -> str:
        """The golden file's text: the canonical JSON of the scenario's trace."""
        return canonical_json(trace_to_dict(self.run()))

    def problems(self, trace: Trace) -> list[str]:
        """How ``trace`` misses what this scenario promises (empty: it does what it says)."""
        out = trace.outcome
        exp = self.expect
        got = {
            "status": out.status,
            "origin": str(out.origin),
            "backend": None if out.backend is None else out.backend.name,
            "reason": out.reason,
            "code": out.code,
        }
        want = {
            "status": exp.status,
            "origin": exp.origin,
            "backend": exp.backend,
            "reason": exp.reason,
            "code": exp.code,
        }
        problems = [
            f"{self.name}: {key} is {got[key]!r}, the scenario expects {want[key]!r}"
            for key in want
            if got[key] != want[key]
        ]
        for text in exp.error_contains:
            if text not in (out.error or ""):
                problems.append(f"{self.name}: the error does not contain {text!r}: {out.error!r}")
        return problems


def _layer(
    head_size: int = 128,
    dtype: str = "bfloat16",
    supported: Iterable[str] | None = None,
    default: str | None = None,
    role: str = "self",
    requires: Iterable[str] = (),
    name: str | None = None,
    exact_route: str | None = None,
) -> LayerSpec:
    return LayerSpec(
        head_size=head_size,
        dtype=dtype,
        supported=None if supported is None else list(supported),
        default=default,
        role=role,
        requirements=list(requires),
        name=name,
        exact_route=exact_route,
    )


def _cli(backend: str) -> SelectionConfig:
    """An operator's explicit ``--attention-backend``."""
    return SelectionConfig(global_backend=backend, global_backend_explicit=True)


def _env(backend: str) -> SelectionConfig:
    """The same choice made through ``ATTNRES_ATTENTION_BACKEND`` (origin ``global_env``)."""
    return SelectionConfig(global_backend=backend, global_backend_env="ATTNRES_ATTENTION_BACKEND")


def _preference(backend: str) -> SelectionConfig:
    """The same setting, derived or defaulted (origin ``global_preference``)."""
    return SelectionConfig(global_backend=backend, global_backend_explicit=False)


_NOTHING = SelectionConfig()
#: issue 35: the facts of the auto-layout golden scenario (4 NVLink ranks, GQA)
_AUTO_GQA_FACTS = LayoutFacts(
    4, 24, 3, seq_len=4096, kv_bytes=2 * 128 * 2, interconnect="nvlink",
    interconnect_source="declared",
)  # fmt: skip
_HOPPER_ALL = "cuda:sm90+all"
#: issue 23: the sglang profile, and a platform of SGLang's observed answers
_SGLANG = SelectionConfig(profile="sglang")


def _sglang_scope(role: Role, backend: str, component_backend: str | None = None) -> ScopeState:
    """SGLang's component context for 'transformer' with one role override."""
    return ScopeState(
        "transformer",
        "sglang",
        "sglang component context",
        None if component_backend is None else Backend(component_backend),
        ((role, Backend(backend)),),
    )


def _host(kind: str, *answers: tuple[str, str | None]) -> Platform:
    return Platform(
        kind,
        host=[
            HostResolution(c, s, None if s else f"Invalid attention backend {c} for {kind}")
            for c, s in answers
        ],
    )


_DENSE_PAIR = ("fa", "torch_sdpa")


def _with_package(base: str, fact: PackageFact) -> Platform:
    platform = Platform.simulate(base)
    packages = tuple(fact if p.name == fact.name else p for p in platform.packages)
    return attrs.evolve(
        platform,
        packages=packages,
        device_name=f"{platform.device_name}, {fact.name} {fact.status}",
    )


_SAGE_BROKEN = _with_package(
    "cuda:sm90+flash_attn",
    PackageFact(
        "sageattention",
        "broken",
        None,
        "import failed: OSError: libcudart.so.12: undefined symbol: cudaGetDriverEntryPoint",
    ),
)

_CPU_OLD_TORCH = attrs.evolve(
    Platform.simulate("cpu"), torch_version="2.5.1", device_name="simulated cpu, torch 2.5.1"
)


# =============================================================================
# The table
# =============================================================================

SCENARIOS: tuple[Scenario, ...] = (
    # -- contract v2, section 1: late binding (the decision a cast makes) ----------
    Scenario(
        "late-bound-bf16-cast-under-strict-global-sage-selects-sage",
        "Late binding: a transformer built in float32 under a strict --attention-backend "
        "sage_attn stays pending (0.1.0 raised at construction) and resolves when the model is "
        "cast to bfloat16; on a simulated Hopper sage_attn takes it.",
        _layer(head_size=64, name="blocks.0.attn1"),
        _cli("sage_attn"),
        scope_state("transformer"),
        _HOPPER_ALL,
        None,
        expect=selects("sage_attn", origin="global_cli"),
    ),
    Scenario(
        "late-bound-fp16-cast-on-hopper-selects-fa",
        "Late binding: a layer built in float32 (where fa cannot run) and cast to float16 "
        "resolves for float16: cuda's chain gives fa, not the float32 decision torch_sdpa.",
        _layer(head_size=64, dtype="float16", name="blocks.0.attn1"),
        _NOTHING,
        None,
        "cuda:sm90+flash_attn",
        None,
        expect=selects("fa", origin="none"),
    ),
    # -- contract v2, section 5: a training forward adds the backward requirement ------
    Scenario(
        "training-forward-global-sage-vae-falls-back-to-fa",
        "A forward that needs gradients on a VAE layer bound to sage_attn (no backward pass) "
        "resolves again with the backward requirement: the relaxed global flag falls back to "
        "fa.",
        _layer(head_size=64, requires=("backward",), name="decoder.mid.attn"),
        _cli("sage_attn"),
        scope_state("vae"),
        "cuda:sm90+flash_attn+sageattention",
        None,
        expect=selects("fa", "global backend fallback", origin="global_cli"),
    ),
    Scenario(
        "training-forward-global-sage-transformer-rejected",
        "The same training forward on the transformer (strict for the global flag) is "
        "rejected before anything is computed: sage_attn has no backward pass.",
        _layer(head_size=64, requires=("backward",), name="blocks.0.attn1"),
        _cli("sage_attn"),
        scope_state("transformer"),
        "cuda:sm90+flash_attn+sageattention",
        None,
        expect=rejects(
            "requirement_unmet", origin="global_cli", error_contains=("the backward pass",)
        ),
    ),
    # -- contract v2, section 2: per-request switching ----------------------------------
    Scenario(
        "request-eager-beats-component-override",
        "attnres.request_backend: one request asks for eager; origin request comes first, so "
        "it beats the component override the server was built with.",
        _layer(head_size=64, dtype="float32", name="blocks.0.attn1"),
        _NOTHING,
        scope_state("transformer", backend="torch_sdpa"),
        "cpu",
        None,
        request="eager",
        expect=selects("eager", origin="request"),
    ),
    Scenario(
        "request-sage-on-float32-layer-rejected-strict",
        "attnres.request_backend: a request is strict; sage_attn cannot take a float32 layer, "
        "so the request is refused for it (and the whole switch with it) instead of falling back.",
        _layer(head_size=64, dtype="float32", name="blocks.0.attn1"),
        _NOTHING,
        scope_state("transformer"),
        _HOPPER_ALL,
        None,
        request="sage_attn",
        expect=rejects("dtype", origin="request", error_contains=("does not take dtype float32",)),
    ),
    # -- contract v2, section 3: the decisions the scope check explains -----------------
    Scenario(
        "component-override-pinned-layer-carries-no-reason",
        "Overrides explain every layer: under --attention-backend transformer=eager a layer "
        "pinned to torch_sdpa in code runs it with no recorded reason; the scope's check names "
        "it on exit (BackendNotAppliedError).",
        _layer(head_size=64, dtype="float32", name="pinned"),
        _NOTHING,
        scope_state("transformer", backend="eager"),
        "cpu",
        "torch_sdpa",
        expect=selects("torch_sdpa", origin="layer"),
    ),
    Scenario(
        "role-override-explains-a-layer-under-a-component-override",
        "Overrides explain every layer: a cross-attention layer governed by the scope's role "
        "override counts as explained under the component override.",
        _layer(head_size=64, dtype="float32", role="cross", name="attn2"),
        _NOTHING,
        scope_state("transformer", backend="eager", role_backends={"cross": "torch_sdpa"}),
        "cpu",
        None,
        expect=selects("torch_sdpa", origin="role_override"),
    ),
    # -- contract v2, section 4: the operator's front door ------------------------------
    Scenario(
        "cli-role-override-transformer-cross-selected",
        "--attention-backend transformer.cross=eager: a role override from the command line "
        "governs the transformer's cross-attention layers (origin role_override, strict).",
        _layer(head_size=64, dtype="float32", role="cross", name="attn2"),
        SelectionConfig(component_backends={"transformer.cross": "eager"}),
        scope_state("transformer"),
        "cpu",
        None,
        expect=selects("eager", origin="role_override"),
    ),
    Scenario(
        "cli-component-name-normalised-text-encoder",
        "--attention-backend Text-Encoder=eager reaches the scope text_encoder: component names "
        "are normalised wherever they are given (0.1.0 matched no scope).",
        _layer(head_size=64, dtype="float32", name="encoder.attn"),
        SelectionConfig(component_backends={"Text-Encoder": "eager"}),
        scope_state("text-encoder"),
        "cpu",
        None,
        expect=selects("eager", origin="component_override"),
    ),
    Scenario(
        "global-env-sage-audio-vae-falls-back",
        "ATTNRES_ATTENTION_BACKEND=sage_attn is the operator's choice with its own origin, "
        "relaxed like the flag: the audio VAE falls back to its default.",
        _layer(supported=_DENSE_PAIR, default="torch_sdpa", name="decoder.mid.attn"),
        _env("sage_attn"),
        scope_state("audio_vae"),
        _HOPPER_ALL,
        None,
        expect=selects("torch_sdpa", "global backend fallback", origin="global_env"),
    ),
    Scenario(
        "global-env-sage-transformer-stays-strict",
        "ATTNRES_ATTENTION_BACKEND=sage_attn is strict like the flag for the transformer: a "
        "layer that supports only {fa, torch_sdpa} rejects it.",
        _layer(supported=_DENSE_PAIR, name="blocks.0.attn1"),
        _env("sage_attn"),
        scope_state("transformer"),
        _HOPPER_ALL,
        None,
        expect=rejects("not_in_supported_set", origin="global_env"),
    ),
    # -- the seed incident: a global --attention-backend sage_attn ------------
    Scenario(
        "audio-vae-global-sage-falls-back-to-default",
        "Seed incident: --attention-backend sage_attn; the audio VAE's layers support "
        "{fa, torch_sdpa} and default to torch_sdpa, so the audio VAE (a loader that allows "
        "global fallback) runs torch_sdpa with the reason 'global backend fallback'.",
        _layer(supported=_DENSE_PAIR, default="torch_sdpa", name="decoder.mid.attn"),
        _cli("sage_attn"),
        scope_state("audio_vae"),
        _HOPPER_ALL,
        None,
        expect=selects("torch_sdpa", "global backend fallback", origin="global_cli"),
    ),
    Scenario(
        "bridge-global-sage-1-installed-head-80-falls-back-to-fa",
        "Issue 31: the machine has the registry's sageattention 1.0.6 (SageAttention 1, head "
        "sizes 64/96/128), not SageAttention 2: under --attention-backend sage_attn a "
        "head-size-80 bridge layer on an RTX 4090 (sm89) falls back to fa, the failure naming "
        "SageAttention 1's facts.",
        _layer(head_size=80, supported=(*_DENSE_PAIR, "sage_attn"), name="proj.attn"),
        _cli("sage_attn"),
        scope_state("bridge"),
        "cuda:sm89+flash_attn+sageattention==1.0.6",
        None,
        expect=selects("fa", "global backend fallback", origin="global_cli"),
    ),
    Scenario(
        "transformer-global-sage-not-supported-rejected",
        "Seed incident: the transformer is the model the flag is aimed at; its layer supports "
        "{fa, torch_sdpa} and declares no default, so sage_attn is rejected with the error "
        "users search for, naming the component.",
        _layer(supported=_DENSE_PAIR, name="blocks.0.attn1"),
        _cli("sage_attn"),
        scope_state("transformer"),
        _HOPPER_ALL,
        None,
        expect=rejects(
            "not_in_supported_set",
            origin="global_cli",
            error_contains=(
                "Attention backend 'sage_attn' is not supported by this attention layer; "
                "supported backends: ['fa', 'torch_sdpa']",
                "for component 'transformer'",
            ),
        ),
    ),
    Scenario(
        "video-vae-global-sage-falls-back-to-platform-default",
        "Seed incident: a video VAE (kind vae) allows global fallback; with no layer default "
        "it falls back to the platform's chain and runs fa ('global backend fallback').",
        _layer(supported=_DENSE_PAIR, name="decoder.mid.attn"),
        _cli("sage_attn"),
        scope_state("video_vae"),
        _HOPPER_ALL,
        None,
        expect=selects("fa", "global backend fallback", origin="global_cli"),
    ),
    Scenario(
        "audio-vae-component-override-sage-stays-strict",
        "Seed incident: an explicit component override is strict even in a scope that allows "
        "global fallback: audio_vae=sage_attn on a {fa, torch_sdpa} layer is rejected.",
        _layer(supported=_DENSE_PAIR, default="torch_sdpa", name="decoder.mid.attn"),
        _cli("sage_attn"),
        scope_state("audio_vae", backend="sage_attn"),
        _HOPPER_ALL,
        None,
        expect=rejects(
            "not_in_supported_set",
            origin="component_override",
            error_contains=(
                "is not supported by this attention layer",
                "for component 'audio_vae'",
            ),
        ),
    ),
    Scenario(
        "unknown-component-global-sage-stays-strict",
        "Seed incident: a component of unknown kind (generic loader) may be the main model, "
        "so the explicit global flag stays strict for it.",
        _layer(supported=_DENSE_PAIR, name="head.attn"),
        _cli("sage_attn"),
        scope_state("motion_prior"),
        _HOPPER_ALL,
        None,
        expect=rejects(
            "not_in_supported_set",
            origin="global_cli",
            error_contains=("for component 'motion_prior'",),
        ),
    ),
    Scenario(
        "transformer-cross-global-sparse-falls-back-to-dense",
        "Seed incident: a sparse global backend never serves cross-attention, even on a layer "
        "with no supported set in the strict transformer: it falls back to dense fa3 (the "
        "Hopper chain's first) with "
        "'dense cross-attention fallback'.",
        _layer(role="cross", name="blocks.0.attn2"),
        _cli("sliding_tile_attn"),
        scope_state("transformer"),
        _HOPPER_ALL,
        None,
        expect=selects("fa3", "dense cross-attention fallback", origin="global_cli"),
    ),
    Scenario(
        "transformer-sage-preference-falls-back-to-platform-default",
        "Seed incident: a derived (not typed) sage_attn preference is relaxed everywhere: the "
        "transformer layer falls back to the platform default fa ('platform default fallback').",
        _layer(supported=_DENSE_PAIR, name="blocks.0.attn1"),
        _preference("sage_attn"),
        scope_state("transformer"),
        _HOPPER_ALL,
        None,
        expect=selects("fa", "platform default fallback", origin="global_preference"),
    ),
    Scenario(
        "transformer-global-sage-selected-when-supported",
        "The explicit global flag is accepted at the requested stage when the transformer "
        "layer supports it (reason none).",
        _layer(supported=("sage_attn", "fa", "torch_sdpa"), name="blocks.0.attn1"),
        _cli("sage_attn"),
        scope_state("transformer"),
        _HOPPER_ALL,
        None,
        expect=selects("sage_attn", origin="global_cli"),
    ),
    Scenario(
        "no-scope-global-sage-without-default-stays-strict",
        "Outside any component scope the component's kind is unknown: the explicit global "
        "flag stays strict for a layer that declares no default.",
        _layer(supported=_DENSE_PAIR),
        _cli("sage_attn"),
        None,
        _HOPPER_ALL,
        None,
        expect=rejects("not_in_supported_set", origin="global_cli"),
    ),
    Scenario(
        "no-scope-global-sage-with-layer-default-falls-back",
        "A layer that declares a default relaxes the explicit global flag even outside a scope.",
        _layer(supported=_DENSE_PAIR, default="torch_sdpa"),
        _cli("sage_attn"),
        None,
        _HOPPER_ALL,
        None,
        expect=selects("torch_sdpa", "global backend fallback", origin="global_cli"),
    ),
    Scenario(
        "text-encoder-2-global-sage-attn-mask-falls-back-to-torch-sdpa",
        "text_encoder_2 is a text_encoder; its masked layer needs attention masks, which "
        "sage_attn and fa do not implement, so the fallback walks the platform chain to "
        "torch_sdpa ('global backend fallback').",
        _layer(head_size=64, dtype="float16", requires=("attn_mask",), name="layers.0.attn"),
        _cli("sage_attn"),
        scope_state("text_encoder_2"),
        _HOPPER_ALL,
        None,
        expect=selects("torch_sdpa", "global backend fallback", origin="global_cli"),
    ),
    Scenario(
        "audio-vae-global-sage-default-fa-missing-falls-back-to-torch-sdpa",
        "The audio VAE's default fa is not installed either: the fallback passes the layer "
        "default (candidate failed) and the platform chain to torch_sdpa.",
        _layer(supported=_DENSE_PAIR, default="fa", name="decoder.mid.attn"),
        _cli("sage_attn"),
        scope_state("audio_vae"),
        "cuda:sm90",
        None,
        expect=selects("torch_sdpa", "global backend fallback", origin="global_cli"),
    ),
    Scenario(
        "bridge-global-sage-on-blackwell-falls-back-to-torch-sdpa",
        "sage_attn (2.x) has no sm100 kernel: on a Blackwell B200 the bridge component falls "
        "back to the sm100 chain (fa4, then torch_sdpa): fa4 is not in its supported set, "
        "so torch_sdpa (issue 31: fa is not preferred where its wheel may lack sm100).",
        _layer(supported=_DENSE_PAIR, name="proj.attn"),
        _cli("sage_attn"),
        scope_state("bridge"),
        "cuda:sm100+all",
        None,
        expect=selects("torch_sdpa", "global backend fallback", origin="global_cli"),
    ),
    Scenario(
        "connector-global-xformers-unsupported-head-size-falls-back",
        "xformers needs a head size that is a multiple of 8: the connector's head size 36 "
        "falls back to torch_sdpa (fa does not take float32 either).",
        _layer(head_size=36, dtype="float32", name="connector.attn"),
        _cli("xformers"),
        scope_state("connector"),
        _HOPPER_ALL,
        None,
        expect=selects("torch_sdpa", "global backend fallback", origin="global_cli"),
    ),
    Scenario(
        "transformer-global-video-sparse-self-attention-selected",
        "A sparse backend serves self-attention: video_sparse_attn is selected for the "
        "transformer's self-attention layer on Hopper.",
        _layer(name="blocks.0.attn1"),
        _cli("video_sparse_attn"),
        scope_state("transformer"),
        _HOPPER_ALL,
        None,
        expect=selects("video_sparse_attn", origin="global_cli"),
    ),
    # -- origin: layer (an explicit per-layer backend, strict) ----------------
    Scenario(
        "layer-fa-selected-on-hopper",
        "A backend passed for one layer is accepted at the requested stage.",
        _layer(requires=("causal",)),
        _NOTHING,
        None,
        "cuda:sm90+flash_attn",
        "fa",
        expect=selects("fa", origin="layer"),
    ),
    Scenario(
        "layer-fa-on-cpu-rejected-platform-kind",
        "fa runs on cuda and rocm only: asking for it on a CPU is rejected (platform_kind), "
        "even with the package installed.",
        _layer(),
        _NOTHING,
        None,
        "cpu+flash_attn",
        "fa",
        expect=rejects(
            "platform_kind", origin="layer", error_contains=("runs on cuda, rocm, not on cpu",)
        ),
    ),
    Scenario(
        "layer-fa-without-flash-attn-rejected-package-missing",
        "fa on Hopper without flash-attn installed is rejected (package_missing).",
        _layer(),
        _NOTHING,
        None,
        "cuda:sm90",
        "fa",
        expect=rejects(
            "package_missing",
            origin="layer",
            error_contains=("package 'flash_attn' is not installed",),
        ),
    ),
    Scenario(
        "layer-sage-broken-package-rejected-package-broken",
        "sageattention is installed but fails to import (an undefined symbol after a CUDA "
        "upgrade): the recorded import error becomes the rejection (package_broken).",
        _layer(),
        _NOTHING,
        None,
        _SAGE_BROKEN,
        "sage_attn",
        expect=rejects("package_broken", origin="layer", error_contains=("undefined symbol",)),
    ),
    Scenario(
        "layer-fa-on-turing-rejected-compute-capability",
        "flash-attn 2 needs Ampere or newer: fa on a T4 (sm75) is rejected (compute_capability).",
        _layer(dtype="float16"),
        _NOTHING,
        None,
        "cuda:sm75+flash_attn",
        "fa",
        expect=rejects("compute_capability", origin="layer"),
    ),
    Scenario(
        "layer-fa-on-unknown-cuda-device-rejected-compute-capability",
        "A CUDA platform whose compute capability is unknown cannot prove fa runs there.",
        _layer(),
        _NOTHING,
        None,
        "cuda+flash_attn",
        "fa",
        expect=rejects("compute_capability", origin="layer", error_contains=("unknown",)),
    ),
    Scenario(
        "layer-aiter-on-mi250-rejected-architecture",
        "aiter's flash attention targets gfx942/gfx950: on an MI250 (gfx90a) it is rejected "
        "(architecture).",
        _layer(),
        _NOTHING,
        None,
        "rocm:gfx90a+aiter",
        "aiter",
        expect=rejects("architecture", origin="layer"),
    ),
    Scenario(
        "layer-fa-float32-rejected-dtype",
        "flash-attn takes fp16/bf16 only: a float32 layer is rejected (dtype).",
        _layer(dtype="float32"),
        _NOTHING,
        None,
        "cuda:sm90+flash_attn",
        "fa",
        expect=rejects("dtype", origin="layer"),
    ),
    Scenario(
        "layer-sage-head-size-256-rejected-head-size",
        "sage_attn takes head sizes up to 128: a 256-wide head is rejected (head_size).",
        _layer(head_size=256),
        _NOTHING,
        None,
        "cuda:sm90+sageattention",
        "sage_attn",
        expect=rejects("head_size", origin="layer"),
    ),
    Scenario(
        "layer-torch-sdpa-packed-varlen-rejected-requirement",
        "torch_sdpa has no packed varlen entry point: a layer that needs it is rejected with "
        "the message users search for (requirement_unmet).",
        _layer(requires=("packed_varlen", "causal")),
        _NOTHING,
        None,
        "cuda:sm90+flash_attn",
        "torch_sdpa",
        expect=rejects(
            "requirement_unmet",
            origin="layer",
            error_contains=(
                "Attention backend 'torch_sdpa' does not implement packed varlen attention",
            ),
        ),
    ),
    Scenario(
        "layer-fa-packed-varlen-selected",
        "fa implements packed varlen attention (flash_attn_varlen_func): accepted.",
        _layer(requires=("packed_varlen", "causal")),
        _NOTHING,
        None,
        "cuda:sm90+flash_attn",
        "fa",
        expect=selects("fa", origin="layer"),
    ),
    Scenario(
        "layer-key-padding-sage-selected-by-unpadding",
        "Issue 22: a joint-attention layer that passes a key-padding mask (Qwen-Image's text "
        "padding), sage_attn requested: sageattn takes no mask, but sageattn_varlen serves "
        "key padding by unpadding, so sage_attn is accepted (schema version 4: the trace "
        "names the mask kind).",
        _layer(requires=("key_padding",)),
        _NOTHING,
        None,
        "cuda:sm90+sageattention",
        "sage_attn",
        expect=selects("sage_attn", origin="layer"),
    ),
    Scenario(
        "layer-additive-mask-sage-rejected-mask-kind",
        "Issue 22: a layer that passes an additive mask (T5's position bias), sage_attn "
        "requested: sage takes key padding only, by unpadding; rejected with the kind named.",
        _layer(requires=("additive",)),
        _NOTHING,
        None,
        "cuda:sm90+sageattention",
        "sage_attn",
        expect=rejects(
            "requirement_unmet",
            origin="layer",
            error_contains=(
                "Attention backend 'sage_attn' does not implement additive masks (the layer's "
                "mask kind is additive mask; it takes key-padding masks by unpadding)",
            ),
        ),
    ),
    Scenario(
        "causal-cross-attention-never-gets-bottom-right-aligned-fa",
        "Nothing requested for a causal cross-attention layer on Hopper with flash-attn: the "
        "chain's fa is usable here (package, device, dtype, head size), is evaluated, and fails "
        "the requirements check (its causal mask is bottom-right aligned when lengths differ); "
        "torch_sdpa (top-left, the layer's convention) serves ('platform default fallback').",
        _layer(role="cross", requires=("causal",)),
        _NOTHING,
        None,
        "cuda:sm90+flash_attn",
        None,
        expect=selects("torch_sdpa", "platform default fallback", origin="none"),
    ),
    Scenario(
        "layer-sage-attn-backward-rejected-requirement",
        "SageAttention has no backward pass (no autograd code at all): a layer that needs "
        "gradients and requests sage_attn is rejected before any kernel runs "
        "(requirement_unmet).",
        _layer(requires=("backward",), name="blocks.0.attn1"),
        _NOTHING,
        None,
        _HOPPER_ALL,
        "sage_attn",
        expect=rejects(
            "requirement_unmet",
            origin="layer",
            error_contains=("Attention backend 'sage_attn' does not implement the backward pass",),
        ),
    ),
    Scenario(
        "training-sage-preference-falls-back-to-fa3",
        "A derived sage_attn preference on a layer that needs the backward pass: sage_attn "
        "fails the requirements check, and fa3 (which has one) serves from the platform's "
        "chain ('platform default fallback').",
        _layer(requires=("backward",), name="blocks.0.attn1"),
        _preference("sage_attn"),
        None,
        _HOPPER_ALL,
        None,
        expect=selects("fa3", "platform default fallback", origin="global_preference"),
    ),
    Scenario(
        "cpu-flex-attention-backward-rejected-limit",
        "flex_attention has a backward pass on CUDA but not on CPU ('FlexAttention does not "
        "support backward on CPU'): the catalogue's limit withdraws the claim on cpu, so a "
        "strict request for it is rejected there (requirement_unmet).",
        _layer(head_size=64, dtype="float32", requires=("backward",)),
        _NOTHING,
        None,
        "cpu",
        "flex_attention",
        expect=rejects(
            "requirement_unmet",
            origin="layer",
            error_contains=(
                "Attention backend 'flex_attention' does not implement the backward pass on cpu",
            ),
        ),
    ),
    Scenario(
        "cuda-flex-attention-backward-selected",
        "The same layer on CUDA: flex_attention has a backward pass there, so the limit does "
        "not apply and the request is accepted.",
        _layer(head_size=64, dtype="bfloat16", requires=("backward",)),
        _NOTHING,
        None,
        "cuda:sm90",
        "flex_attention",
        expect=selects("flex_attention", origin="layer"),
    ),
    Scenario(
        "xformers-gqa-backward-rejected-limit",
        "xformers takes grouped-query attention forward only (its backward op refuses the 5-D "
        "GQA layout): a GQA layer that needs gradients is rejected for xformers "
        "(requirement_unmet), while the same layer without the backward requirement is served.",
        _layer(head_size=64, requires=("gqa", "backward")),
        _NOTHING,
        None,
        "cuda:sm80+xformers",
        "xformers",
        expect=rejects(
            "requirement_unmet",
            origin="layer",
            error_contains=(
                "does not implement the backward pass together with grouped-query attention",
            ),
        ),
    ),
    Scenario(
        "fastvideo-kernel-makes-video-sparse-attn-available",
        "FastVideo merged st_attn, vsa and VMoBA into one package, fastvideo_kernel (PyPI "
        "fastvideo-kernel): a current install, which has no vsa module, serves "
        "video_sparse_attn.",
        _layer(name="blocks.0.attn1"),
        _NOTHING,
        scope_state("transformer"),
        "cuda:sm90+fastvideo_kernel",
        "video_sparse_attn",
        expect=selects("video_sparse_attn", origin="layer"),
    ),
    Scenario(
        "old-vsa-package-still-serves-video-sparse-attn",
        "An install from before FastVideo merged its kernels has the vsa module only: it still "
        "serves video_sparse_attn.",
        _layer(name="blocks.0.attn1"),
        _NOTHING,
        scope_state("transformer"),
        "cuda:sm90+vsa",
        "video_sparse_attn",
        expect=selects("video_sparse_attn", origin="layer"),
    ),
    Scenario(
        "vmoba-needs-flash-attn-beside-fastvideo-kernel",
        "VMoBA calls flash-attn's varlen forward: fastvideo_kernel alone does not make it "
        "available (package_missing names flash_attn).",
        _layer(name="blocks.0.attn1"),
        _NOTHING,
        None,
        "cuda:sm90+fastvideo_kernel",
        "vmoba_attn",
        expect=rejects(
            "package_missing",
            origin="layer",
            error_contains=("package 'flash_attn' is not installed",),
        ),
    ),
    Scenario(
        "vmoba-head-size-not-multiple-of-8-rejected",
        "VMoBA calls flash-attn's private _flash_attn_varlen_forward, which skips the "
        "wrapper's padding: a head size of 100 (not a multiple of 8) is refused.",
        _layer(head_size=100),
        _NOTHING,
        None,
        _HOPPER_ALL,
        "vmoba_attn",
        expect=rejects("head_size", origin="layer", error_contains=("is not a multiple of 8",)),
    ),
    Scenario(
        "sage-attn-3-selected-on-sm121",
        "SageAttention3 runs on sm121 (DGX Spark) as well as sm120 (api.cu: is_sm120 || is_sm121).",
        _layer(),
        _NOTHING,
        None,
        "cuda:sm121+sageattn3",
        "sage_attn_3",
        expect=selects("sage_attn_3", origin="layer"),
    ),
    Scenario(
        "xformers-bf16-below-sm80-rejected",
        "xformers' cutlass op refuses bf16 below sm80 ('bf16 is only supported on A100+ "
        "GPUs'): a bf16 layer on sm75 is rejected with a dtype failure, while fp16 runs.",
        _layer(head_size=64),
        _NOTHING,
        None,
        "cuda:sm75+xformers",
        "xformers",
        expect=rejects(
            "dtype",
            origin="layer",
            error_contains=("takes dtype bfloat16 only on compute capability >= sm80",),
        ),
    ),
    Scenario(
        "custom-scale-sliding-tile-preference-falls-back-to-fa3",
        "Sliding Tile Attention hard-codes 1/sqrt(head_size) (no scale argument): a layer "
        "with another softmax scale never gets it, even when it is the preferred backend; fa3 "
        "(softmax_scale) serves from the platform's chain ('platform default fallback').",
        _layer(requires=("custom_scale",), name="blocks.0.attn1"),
        _preference("sliding_tile_attn"),
        scope_state("transformer"),
        _HOPPER_ALL,
        None,
        expect=selects("fa3", "platform default fallback", origin="global_preference"),
    ),
    Scenario(
        "layer-sage-attn-3-custom-scale-rejected-requirement",
        "SageAttention3 has no scale argument: a strict request for it on a layer with a "
        "custom softmax scale is rejected (requirement_unmet) rather than computed with "
        "another scale.",
        _layer(requires=("custom_scale",)),
        _NOTHING,
        None,
        "cuda:sm120+all",
        "sage_attn_3",
        expect=rejects(
            "requirement_unmet",
            origin="layer",
            error_contains=(
                "Attention backend 'sage_attn_3' does not implement a custom softmax scale",
            ),
        ),
    ),
    Scenario(
        "softcap-layer-on-hopper-selects-fa",
        "Nothing requested for a layer with logit softcapping on Hopper with flash-attn: the "
        "chain's fa implements softcap and is accepted (reason none).",
        _layer(requires=("softcap",)),
        _NOTHING,
        None,
        "cuda:sm90+flash_attn",
        None,
        expect=selects("fa", origin="none"),
    ),
    Scenario(
        "layer-fa-softcap-with-dropout-rejected-limit",
        "flash-attn 2 refuses softcapping together with dropout ('Softcapping does not "
        "support dropout for now'): the catalogue's limit rejects a layer that needs both "
        "(requirement_unmet).",
        _layer(requires=("softcap", "dropout")),
        _NOTHING,
        None,
        "cuda:sm90+flash_attn",
        "fa",
        expect=rejects(
            "requirement_unmet",
            origin="layer",
            error_contains=(
                "does not implement logit softcapping together with attention dropout",
            ),
        ),
    ),
    Scenario(
        "sliding-window-layer-on-cpu-selects-torch-sdpa",
        "A sliding-window layer on CPU: torch_sdpa has no window argument, and attnres's "
        "adapter builds the window as a mask, so the platform default serves it.",
        _layer(head_size=64, dtype="float32", requires=("sliding_window", "causal")),
        _NOTHING,
        None,
        "cpu",
        None,
        expect=selects("torch_sdpa", origin="none"),
    ),
    Scenario(
        "layer-sage-attn-sliding-window-rejected-requirement",
        "SageAttention takes no window: a strict request for it on a sliding-window layer is "
        "rejected (requirement_unmet).",
        _layer(requires=("sliding_window",)),
        _NOTHING,
        None,
        _HOPPER_ALL,
        "sage_attn",
        expect=rejects(
            "requirement_unmet",
            origin="layer",
            error_contains=(
                "Attention backend 'sage_attn' does not implement sliding-window attention",
            ),
        ),
    ),
    Scenario(
        "layer-fa-causal-cross-attention-rejected-requirement",
        "fa requested for a causal cross-attention layer: its causal mask is bottom-right aligned "
        "when lengths differ, so the strict request is rejected (requirement_unmet).",
        _layer(role="cross", requires=("causal",)),
        _NOTHING,
        None,
        "cuda:sm90+flash_attn",
        "fa",
        expect=rejects(
            "requirement_unmet",
            origin="layer",
            error_contains=("does not implement top-left aligned causal cross-attention",),
        ),
    ),
    Scenario(
        "layer-flex-attention-old-torch-rejected-torch-version",
        "flex_attention on CPU needs torch >= 2.6: a platform recording torch 2.5.1 rejects it "
        "(torch_version).",
        _layer(head_size=64, dtype="float32"),
        _NOTHING,
        None,
        _CPU_OLD_TORCH,
        "flex_attention",
        expect=rejects("torch_version", origin="layer"),
    ),
    Scenario(
        "layer-sparse-on-cross-attention-falls-back-to-dense",
        "Even a strict per-layer request for a sparse backend falls back to dense on a "
        "cross-attention layer (SPEC 3.3, the one exception to strictness).",
        _layer(role="cross"),
        _NOTHING,
        None,
        _HOPPER_ALL,
        "video_sparse_attn",
        expect=selects("fa3", "dense cross-attention fallback", origin="layer"),
    ),
    Scenario(
        "layer-sparse-on-cpu-cross-attention-falls-back-to-torch-sdpa",
        "A sparse backend requested for a cross-attention layer on a CPU: dense fallback "
        "through the platform chain.",
        _layer(role="cross", dtype="float32", head_size=64),
        _NOTHING,
        None,
        "cpu",
        "sliding_tile_attn",
        expect=selects("torch_sdpa", "dense cross-attention fallback", origin="layer"),
    ),
    Scenario(
        "cross-layer-supporting-only-sparse-backends-rejected",
        "A cross-attention layer whose supported set holds only sparse backends has no dense "
        "fallback: no compatible backend.",
        _layer(role="cross", supported=("sliding_tile_attn", "video_sparse_attn")),
        _NOTHING,
        None,
        _HOPPER_ALL,
        "sliding_tile_attn",
        expect=rejects("no_compatible_backend", origin="layer"),
    ),
    # -- selected means runnable: layers that will run need a kernel --------------
    Scenario(
        "attention-layer-sparse-request-rejected-no-kernel",
        "A layer that will run (attnres.Attention) asks for a sparse backend on self-attention: "
        "attnres ships no kernel for it, so the strict request is rejected (no_kernel) with "
        "a message saying how to register one.",
        _layer(name="blocks.0.attn1"),
        _NOTHING,
        None,
        _HOPPER_ALL,
        "sliding_tile_attn",
        expect=rejects(
            "no_kernel",
            origin="layer",
            error_contains=(
                "Attention backend 'sliding_tile_attn' is not available: no kernel in this process",
                "attnres.kernels.register_kernel('sliding_tile_attn', fn)",
            ),
        ),
        needs_kernel=True,
    ),
    Scenario(
        "attention-layer-global-sparse-falls-back-no-kernel",
        "The operator's global sparse backend, relaxed for a text encoder whose layers will "
        "run: no kernel, so it falls back to the platform chain ('global backend fallback').",
        _layer(name="encoder.layers.0.attn"),
        _cli("video_sparse_attn"),
        scope_state("text_encoder"),
        _HOPPER_ALL,
        None,
        expect=selects("fa3", "global backend fallback", origin="global_cli"),
        needs_kernel=True,
    ),
    # -- origin: forced ---------------------------------------------------------
    Scenario(
        "forced-torch-sdpa-selected-on-rocm",
        "A process-wide forced backend wins over the platform chain (aiter) on ROCm.",
        _layer(),
        SelectionConfig(forced_backend="torch_sdpa"),
        None,
        "rocm:gfx942+aiter",
        None,
        expect=selects("torch_sdpa", origin="forced"),
    ),
    Scenario(
        "forced-sage-rejected-on-layer-without-it",
        "A forced backend is strict: sage_attn forced onto a {fa, torch_sdpa} layer is "
        "rejected, even inside an auxiliary component.",
        _layer(supported=_DENSE_PAIR, default="torch_sdpa"),
        SelectionConfig(forced_backend="sage_attn"),
        scope_state("vae"),
        _HOPPER_ALL,
        None,
        expect=rejects(
            "not_in_supported_set", origin="forced", error_contains=("for component 'vae'",)
        ),
    ),
    # -- origin: role_override / component_override ----------------------------
    Scenario(
        "transformer-cross-role-override-torch-sdpa-selected",
        "transformer.cross=torch_sdpa: the cross-attention layer runs torch_sdpa although the "
        "component override is fa.",
        _layer(role="cross", name="blocks.0.attn2"),
        _cli("sage_attn"),
        scope_state("transformer", backend="fa", role_backends={"cross": "torch_sdpa"}),
        _HOPPER_ALL,
        None,
        expect=selects("torch_sdpa", origin="role_override"),
    ),
    Scenario(
        "transformer-self-layer-uses-component-override-not-cross-role",
        "The cross role override does not touch self-attention layers: they take the "
        "component override fa.",
        _layer(role="self", name="blocks.0.attn1"),
        _cli("sage_attn"),
        scope_state("transformer", backend="fa", role_backends={"cross": "torch_sdpa"}),
        _HOPPER_ALL,
        None,
        expect=selects("fa", origin="component_override"),
    ),
    Scenario(
        "transformer-cross-role-override-sage-attn-mask-rejected",
        "A role override is strict: transformer.cross=sage_attn on a masked cross-attention "
        "layer is rejected (sage_attn does not implement attention masks).",
        _layer(role="cross", requires=("attn_mask",), name="blocks.0.attn2"),
        _NOTHING,
        scope_state("transformer", role_backends={"cross": "sage_attn"}),
        _HOPPER_ALL,
        None,
        expect=rejects(
            "requirement_unmet",
            origin="role_override",
            error_contains=("does not implement attention masks", "for component 'transformer'"),
        ),
    ),
    Scenario(
        "vae-component-override-torch-sdpa-selected",
        "component_scope('vae', backend='torch_sdpa') is accepted at the requested stage.",
        _layer(supported=_DENSE_PAIR, default="fa"),
        _NOTHING,
        scope_state("vae", backend="torch_sdpa"),
        _HOPPER_ALL,
        None,
        expect=selects("torch_sdpa", origin="component_override"),
    ),
    Scenario(
        "vocoder-config-component-backend-eager-selected",
        "--attention-backend vocoder=eager (the per-component form of the flag) acts as the "
        "vocoder's component override.",
        _layer(head_size=64, dtype="float32"),
        SelectionConfig(global_backend="sage_attn", component_backends={"vocoder": "eager"}),
        scope_state("vocoder"),
        _HOPPER_ALL,
        None,
        expect=selects("eager", origin="component_override"),
    ),
    # -- origin: layer_default / none -------------------------------------------
    Scenario(
        "layer-default-torch-sdpa-selected",
        "Nothing requested: the layer's declared default is accepted first (reason none).",
        _layer(head_size=64, dtype="float32", default="torch_sdpa"),
        _NOTHING,
        None,
        "cpu",
        None,
        expect=selects("torch_sdpa", origin="layer_default"),
    ),
    Scenario(
        "layer-default-fa-on-cpu-falls-back-to-platform-default",
        "A layer default that cannot run here (fa on a CPU) is relaxed: the platform chain "
        "gives torch_sdpa ('platform default fallback'); the default is not evaluated twice.",
        _layer(default="fa"),
        _NOTHING,
        None,
        "cpu",
        None,
        expect=selects("torch_sdpa", "platform default fallback", origin="layer_default"),
    ),
    Scenario(
        "none-cuda-hopper-picks-fa",
        "Nothing requested, no default: the CUDA chain's first backend, fa, is accepted.",
        _layer(),
        _NOTHING,
        None,
        "cuda:sm90+flash_attn",
        None,
        expect=selects("fa", origin="none"),
    ),
    Scenario(
        "none-cuda-blackwell-sm100-picks-fa4",
        "Nothing requested on a B200 (sm100) with every package: the sm100 chain (issue 31) "
        "prefers fa4, not fa (a flash-attn wheel built without sm100 dies at its first call).",
        _layer(),
        _NOTHING,
        None,
        "cuda:sm100+all",
        None,
        expect=selects("fa4", origin="none"),
    ),
    Scenario(
        "none-cuda-sm120-picks-torch-sdpa",
        "Nothing requested on an RTX 50 (sm120) with every package: the sm120 chain (issue "
        "31) is torch_sdpa alone, which dispatches flash, cuDNN or efficient attention itself.",
        _layer(),
        _NOTHING,
        None,
        "cuda:sm120+all",
        None,
        expect=selects("torch_sdpa", origin="none"),
    ),
    Scenario(
        "none-rocm-mi250-gfx90a-picks-fa",
        "Nothing requested on an MI250 (gfx90a) with every package: aiter has no gfx90a "
        "build, so the gfx90a chain (issue 31) prefers fa (flash-attn's CK backend).",
        _layer(),
        _NOTHING,
        None,
        "rocm:gfx90a+all",
        None,
        expect=selects("fa", origin="none"),
    ),
    Scenario(
        "none-cuda-without-flash-attn-passes-over-fa-to-torch-sdpa",
        "Nothing requested on CUDA without flash-attn: the chain prefers fa only where it is "
        "usable, so it is passed over (a skip record says why) and torch_sdpa serves with no "
        "fallback reason.",
        _layer(),
        _NOTHING,
        None,
        "cuda:sm90",
        None,
        expect=selects("torch_sdpa", None, origin="none"),
    ),
    Scenario(
        "none-single-supported-backend-component-constraint",
        "Nothing requested and the layer supports exactly one backend: it is chosen with the "
        "reason 'component constraint'.",
        _layer(head_size=64, dtype="float32", supported=("eager",)),
        _NOTHING,
        None,
        "cpu",
        None,
        expect=selects("eager", "component constraint", origin="none"),
    ),
    Scenario(
        "none-single-supported-fa-on-cpu-rejected",
        "The single supported backend cannot run here: no compatible backend.",
        _layer(supported=("fa",)),
        _NOTHING,
        None,
        "cpu",
        None,
        expect=rejects(
            "no_compatible_backend",
            origin="none",
            error_contains=("No compatible attention backend is available",),
        ),
    ),
    Scenario(
        "none-supported-set-reached-picks-eager",
        "The platform chain (torch_sdpa) is outside the layer's supported set {eager, fa}: the "
        "supported-set stage picks eager.",
        _layer(head_size=64, dtype="float32", supported=("fa", "eager")),
        _NOTHING,
        None,
        "cpu",
        None,
        expect=selects("eager", "platform default fallback", origin="none"),
    ),
    Scenario(
        "none-supported-set-exhausted-rejected",
        "No backend of the supported set {fa, sage_attn} runs on a CPU: every stage is "
        "exhausted (no_compatible_backend).",
        _layer(supported=("fa", "sage_attn")),
        _NOTHING,
        None,
        "cpu",
        None,
        expect=rejects("no_compatible_backend", origin="none"),
    ),
    # -- aliases ------------------------------------------------------------------
    Scenario(
        "alias-torch-cudnn-sdpa-satisfies-torch-sdpa",
        "torch_cudnn_sdpa counts as torch_sdpa: it is accepted on a layer that supports only "
        "torch_sdpa.",
        _layer(dtype="float16", supported=("torch_sdpa",)),
        _NOTHING,
        None,
        "cuda:sm90",
        "torch_cudnn_sdpa",
        expect=selects("torch_cudnn_sdpa", origin="layer"),
    ),
    Scenario(
        "alias-dynamic-cudnn-sdpa-satisfies-fa-and-torch-sdpa",
        "dynamic_cudnn_sdpa stands in for fa and torch_sdpa together: accepted on a "
        "{fa, torch_sdpa} layer.",
        _layer(supported=_DENSE_PAIR),
        _NOTHING,
        scope_state("transformer", backend="dynamic_cudnn_sdpa"),
        "cuda:sm90",
        None,
        expect=selects("dynamic_cudnn_sdpa", origin="component_override"),
    ),
    Scenario(
        "alias-dynamic-cudnn-sdpa-rejected-with-torch-sdpa-only",
        "dynamic_cudnn_sdpa needs both fa and torch_sdpa in the supported set: a layer that "
        "supports only torch_sdpa rejects it.",
        _layer(supported=("torch_sdpa",)),
        _NOTHING,
        scope_state("transformer", backend="dynamic_cudnn_sdpa"),
        "cuda:sm90",
        None,
        expect=rejects("not_in_supported_set", origin="component_override"),
    ),
    # -- an integration route that runs exactly its supported set (issue 21) ----
    Scenario(
        "exact-route-rejects-a-stand-in-for-a-strict-override",
        "A text encoder's transformers attention interface runs exactly the functions it "
        "names: torch_cudnn_sdpa only stands in for torch_sdpa, so a component override "
        "(strict) is rejected, naming the route.",
        _layer(
            dtype="float16",
            supported=("eager", "torch_sdpa"),
            exact_route="transformers attention interface",
        ),
        _NOTHING,
        scope_state("text_encoder", backend="torch_cudnn_sdpa"),
        "cuda:sm90",
        None,
        expect=rejects(
            "not_on_route",
            origin="component_override",
            error_contains=("route (transformers attention interface)",),
        ),
    ),
    Scenario(
        "exact-route-stand-in-falls-back-for-the-global-flag",
        "The same route under the operator's --attention-backend torch_cudnn_sdpa: the text "
        "encoder allows global fallback, so its current backend (the declared default) runs.",
        _layer(
            dtype="float16",
            supported=("eager", "torch_sdpa"),
            default="torch_sdpa",
            exact_route="transformers attention interface",
        ),
        _cli("torch_cudnn_sdpa"),
        scope_state("text_encoder"),
        "cuda:sm90",
        None,
        expect=selects("torch_sdpa", "global backend fallback", origin="global_cli"),
    ),
    Scenario(
        "by-hand-site-falls-back-for-the-global-flag",
        "Issue 30: softmax attention a text encoder's code writes by hand runs only its own "
        "code (the route runs exactly eager: no kernel is offered there). Under the "
        "operator's --attention-backend torch_sdpa the text encoder (global fallback "
        "allowed) keeps it, with the reason 'softmax attention written by hand'.",
        _layer(
            supported=("eager",),
            default="eager",
            exact_route="the site's own code (softmax attention written by hand in BloomAttention)",
        ),
        _cli("torch_sdpa"),
        scope_state("text_encoder"),
        "cuda:sm90",
        None,
        expect=selects("eager", "softmax attention written by hand", origin="global_cli"),
    ),
    # -- platform kinds -------------------------------------------------------------
    Scenario(
        "rocm-mi300-picks-aiter",
        "ROCm's chain starts with aiter: an MI300 (gfx942) with aiter installed runs it.",
        _layer(),
        _NOTHING,
        None,
        "rocm:gfx942+aiter",
        None,
        expect=selects("aiter", origin="none"),
    ),
    Scenario(
        "mps-picks-torch-sdpa",
        "Apple MPS: torch_sdpa, the only entry of its chain.",
        _layer(head_size=64, dtype="float16"),
        _NOTHING,
        None,
        "mps",
        None,
        expect=selects("torch_sdpa", origin="none"),
    ),
    Scenario(
        "xpu-fa-preference-falls-back-to-torch-sdpa",
        "Intel XPU with a defaulted fa preference: fa does not run on xpu, torch_sdpa does.",
        _layer(dtype="bfloat16"),
        _preference("fa"),
        None,
        "xpu",
        None,
        expect=selects("torch_sdpa", "platform default fallback", origin="global_preference"),
    ),
    Scenario(
        "npu-picks-ascend-fa",
        "Ascend NPU with torch_npu: the chain's ascend_fa is accepted.",
        _layer(),
        _NOTHING,
        None,
        "npu+torch_npu",
        None,
        expect=selects("ascend_fa", origin="none"),
    ),
    Scenario(
        "npu-without-torch-npu-passes-over-ascend-fa-to-torch-sdpa",
        "Ascend NPU without torch_npu recorded: ascend_fa is not usable, so the chain passes "
        "over it and torch_sdpa serves with no fallback reason.",
        _layer(),
        _NOTHING,
        None,
        "npu",
        None,
        expect=selects("torch_sdpa", None, origin="none"),
    ),
    # -- issue 23: the sglang profile (SGLang 0.5.23's selector rules as rows) ----------
    Scenario(
        "sglang-profile-explicit-aiter-outside-the-declared-set-is-admitted",
        "The sglang profile: an explicit backend is admitted by capability outside the "
        "layer's declared set {fa, torch_sdpa} (SGLang PR 37441); SGLang's platform resolved "
        "aiter (the observed host fact).",
        _layer(head_size=128, supported=("fa", "torch_sdpa")),
        _SGLANG,
        None,
        _host("rocm", ("aiter", "aiter")),
        "aiter",
        expect=selects("aiter", origin="layer"),
    ),
    Scenario(
        "sglang-profile-cross-role-override-records-its-role",
        "The sglang profile: a component's cross-attention override records "
        "'cross-attention override' as its reason, as SGLang does.",
        _layer(head_size=128, role="cross"),
        _SGLANG,
        _sglang_scope(Role.CROSS, "torch_sdpa", component_backend="fa"),
        _host("cuda", ("torch_sdpa", "torch_sdpa")),
        None,
        expect=selects("torch_sdpa", "cross-attention override", origin="role_override"),
    ),
    Scenario(
        "sglang-profile-self-role-override-records-its-role",
        "The sglang profile: a component's self-attention override records "
        "'self-attention override' as its reason.",
        _layer(head_size=128),
        _SGLANG,
        _sglang_scope(Role.SELF, "sage_attn"),
        _host("cuda", ("sage_attn", "sage_attn")),
        None,
        expect=selects("sage_attn", "self-attention override", origin="role_override"),
    ),
    Scenario(
        "sglang-profile-global-cli-refused-by-the-host-platform-is-rejected",
        "The sglang profile: --attention-backend sage_attn typed by the operator is strict for "
        "a layer without a default outside a component; SGLang's platform refused it.",
        _layer(head_size=128),
        SelectionConfig(global_backend="sage_attn", profile="sglang"),
        None,
        _host("cuda", ("sage_attn", None)),
        None,
        expect=rejects("host_platform", origin="global_cli", error_contains=("sage_attn",)),
    ),
    # -- issue 36: the vllm_omni profile (vLLM-Omni 0.30.0's selector rules as rows) -----
    Scenario(
        "vllm-omni-profile-role-category-entry-wins-over-the-default",
        "The vllm_omni profile: attention_config.per_role['cross'] (the role category of "
        "'ltx2.audio_to_video') wins over attention_config.default; vLLM-Omni's platform "
        "resolved sage_attn (the observed host fact).",
        _layer(head_size=128, role="cross", name="ltx2.audio_to_video"),
        SelectionConfig(global_backend="torch_sdpa", profile="vllm_omni"),
        ScopeState("cross", "vllm_omni", "attention_config.per_role", Backend("sage_attn")),
        _host("cuda", ("sage_attn", "sage_attn")),
        None,
        expect=selects("sage_attn", origin="component_override"),
    ),
    Scenario(
        "vllm-omni-profile-platform-default-the-layer-cannot-run-falls-back-to-torch-sdpa",
        "The vllm_omni profile: nothing configured; vLLM-Omni's platform picks sage_attn_3, "
        "whose class cannot take head size 80 (vLLM-Omni would fail when the layer runs); "
        "nobody chose it, so attnres falls back to TORCH_SDPA.",
        _layer(head_size=80, name="self"),
        SelectionConfig(profile="vllm_omni"),
        None,
        Platform(
            "cuda",
            host=[
                HostResolution(
                    "", "sage_attn_3", missing=("head size 80 (its supports_head_size)",)
                ),
                HostResolution("torch_sdpa", "torch_sdpa"),
            ],
        ),
        None,
        expect=selects("torch_sdpa", "platform default fallback", origin="none"),
    ),
    Scenario(
        "vllm-omni-profile-configured-backend-refused-by-the-platform-is-rejected",
        "The vllm_omni profile: attention_config.default = FLASH_ATTN on a GPU vLLM-Omni's "
        "platform cannot run it on; its refusal is the answer (vLLM-Omni has no fallback).",
        _layer(head_size=128, name="joint"),
        SelectionConfig(global_backend="fa", profile="vllm_omni"),
        None,
        _host("cuda", ("fa", None)),
        None,
        expect=rejects("host_platform", origin="global_cli", error_contains=("fa",)),
    ),
    Scenario(
        "vllm-omni-profile-exact-role-entry-on-a-simulated-hopper",
        "The vllm_omni profile: attention_config.per_role['cross'] is the layer's own role "
        "(the exact entry wins); vLLM-Omni's CudaOmniPlatform, simulated as an H100, "
        "resolved TORCH_SDPA, and the decision records the capability and device name it "
        "states (the tiny pipeline of tests/vllm_omni/test_pipeline_hopper.py).",
        _layer(head_size=64, role="cross", name="cross"),
        SelectionConfig(profile="vllm_omni"),
        None,
        Platform(
            "cuda",
            capability=(9, 0),
            device_name="NVIDIA H100 80GB HBM3",
            host=[HostResolution("torch_sdpa", "torch_sdpa")],
        ),
        Backend("torch_sdpa"),
        expect=selects("torch_sdpa", origin="layer"),
    ),
    Scenario(
        "vllm-omni-profile-platform-default-on-a-simulated-hopper",
        "The vllm_omni profile: nothing configured for the role; vLLM-Omni's CudaOmniPlatform, "
        "simulated as an H100 without the flash-attn package, picks TORCH_SDPA by its own "
        "chain, which the layer can run: vLLM-Omni's answer stands.",
        _layer(head_size=64, name="self"),
        SelectionConfig(profile="vllm_omni"),
        None,
        Platform(
            "cuda",
            capability=(9, 0),
            device_name="NVIDIA H100 80GB HBM3",
            host=[HostResolution("", "torch_sdpa")],
        ),
        None,
        expect=selects("torch_sdpa", origin="none"),
    ),
    # -- issue 24: sequence-parallel layouts (LayerSpec.layout, the layout check) ---
    Scenario(
        "ring-layout-rejects-kernel-without-lse",
        "A layer under a ring layout (ring=2) asks for dynamic_cudnn_sdpa on Hopper: no source "
        "says it returns the softmax log-sum-exp a ring merges its blocks with, so the strict "
        "request is rejected (no_lse) by the layout check.",
        attrs.evolve(_layer(name="blocks.0.attn1"), layout=SequenceLayout(1, 2, 24, 24)),
        _NOTHING,
        None,
        "cuda:sm90+flash_attn+sageattention",
        "dynamic_cudnn_sdpa",
        expect=rejects(
            "no_lse",
            origin="layer",
            error_contains=(
                "cannot serve this layer's sequence-parallel layout",
                "cannot return the softmax log-sum-exp, which ring=2 needs",
            ),
        ),
    ),
    Scenario(
        "usp-layout-selects-fa-per-rank",
        "Ulysses 2 x ring 2 on Hopper with flash-attn and SageAttention: each rank runs 12 of "
        "24 heads, and fa (which returns the log-sum-exp) passes the layout check.",
        attrs.evolve(_layer(name="blocks.0.attn1"), layout=SequenceLayout(2, 2, 24, 24)),
        _NOTHING,
        None,
        "cuda:sm90+flash_attn+sageattention",
        None,
        expect=selects("fa", origin="none"),
    ),
    Scenario(
        "ulysses-layout-with-attention-mask-rejected",
        "A masked joint-attention layer (HunyuanVideo's) under ulysses=2: attnres's layouts "
        "apply no attention mask, so every candidate fails the layout check and nothing can "
        "serve it (layout_unsupported in every candidate's trace).",
        attrs.evolve(
            _layer(name="transformer_blocks.attn", requires=["attn_mask"]),
            layout=SequenceLayout(2, 1, 24, 24),
        ),
        _NOTHING,
        None,
        "cuda:sm90+flash_attn+sageattention",
        "torch_sdpa",
        expect=rejects(
            "layout_unsupported",
            origin="layer",
            error_contains=("attention masks, which attnres's sequence-parallel layouts",),
        ),
    ),
    Scenario(
        "ulysses-layout-heads-not-divisible-rejected",
        "ulysses=4 on a layer of 6 heads: a rank cannot run a quarter of them, so the "
        "layout check fails for every candidate and the strict request is rejected "
        "(heads_not_divisible).",
        attrs.evolve(_layer(name="blocks.0.attn1"), layout=SequenceLayout(4, 1, 6, 6)),
        _NOTHING,
        None,
        "cuda:sm90+flash_attn+sageattention",
        "fa",
        expect=rejects(
            "heads_not_divisible",
            origin="layer",
            error_contains=("6 heads and 6 kv heads do not both divide by 4",),
        ),
    ),
    # -- issue 35: layout kinds (head padding, AllGather-KV) and layout="auto" ----------
    Scenario(
        "auto-layout-gqa-allgather-kv-selects-fa",
        "SequenceParallel(layout='auto') over 4 NVLink ranks for a non-causal GQA layer (24 "
        "heads, 3 kv heads, 4096 tokens): the rule gqa_allgather_kv chooses AllGather-KV, "
        "whose rule and why ride in the layout, and fa serves each rank's query shard.",
        attrs.evolve(
            _layer(name="blocks.0.attn1"),
            layout=choose_layout(_AUTO_GQA_FACTS),
        ),
        _NOTHING,
        None,
        "cuda:sm90+flash_attn+sageattention",
        None,
        expect=selects("fa", origin="none"),
    ),
    Scenario(
        "padded-heads-layout-rejected-padding-too-costly",
        "ulysses=4 with padded heads on a layer of 2 heads and 1 kv head: padding the kv "
        "head to 4 takes the query heads to 8, four times the work, so the strict request "
        "is rejected (padding_too_costly).",
        attrs.evolve(
            _layer(name="blocks.0.attn1"), layout=SequenceLayout(4, 1, 2, 1, pad_heads=True)
        ),
        _NOTHING,
        None,
        "cuda:sm90+flash_attn+sageattention",
        "fa",
        expect=rejects(
            "padding_too_costly", origin="layer", error_contains=("4.00x the attention work",)
        ),
    ),
    Scenario(
        "allgather-kv-layout-causal-rejected",
        "allgather=2 on a causal layer: each rank's query shard would need a bottom-right "
        "causal mask over the gathered keys, so the strict request is rejected "
        "(allgather_causal).",
        attrs.evolve(
            _layer(name="blocks.0.attn1", requires=["causal"]),
            layout=SequenceLayout(1, 1, 8, 8, allgather=2),
        ),
        _NOTHING,
        None,
        "cuda:sm90+flash_attn+sageattention",
        "fa",
        expect=rejects(
            "allgather_causal", origin="layer", error_contains=("bottom-right-aligned mask",)
        ),
    ),
)


# =============================================================================
# Issue 34: precision -- error budgets against lossy kernels
# =============================================================================


def _budget(backend: str, budgets: dict[str, str | float]) -> SelectionConfig:
    """``--attention-backend BACKEND --attention-error ...``."""
    return SelectionConfig(
        global_backend=backend, global_backend_explicit=True, attention_error=budgets
    )


#: The emulated SageAttention 2 on sm90 (attnres.kernels.sage_emulated) on one
#: bf16 (1, 256, 2, 128) self-attention input against a float64 reference.
_SAGE_SM90_MEASURED = ErrorMeasurement(
    Backend("sage_attn"), 0.036862, 0.02109, 0.999322, "q (1, 256, 2, 128) bfloat16", True
)

PRECISION_SCENARIOS: tuple[Scenario, ...] = (
    Scenario(
        "precision-vae-exact-budget-global-sage-falls-back-to-fa",
        "Issue 34: --attention-backend sage_attn --attention-error vae=exact,transformer=2e-2 "
        "on a Hopper: SageAttention is lossy (int8 Q and K, fp8 P and V), so the VAE's "
        "precision check fails with lossy_kernel and the VAE (which allows global fallback) "
        "runs fa, exact to its dtype, with the reason 'global backend fallback'.",
        _layer(head_size=128, name="decoder.mid_block.attentions.0"),
        _budget("sage_attn", {"vae": "exact", "transformer": 2e-2}),
        scope_state("vae"),
        "cuda:sm90+flash_attn+sageattention",
        None,
        expect=selects("fa", "global backend fallback", origin="global_cli"),
    ),
    Scenario(
        "precision-vae-override-sage-rejected-lossy-kernel",
        "Issue 34: --attention-backend vae=sage_attn with --attention-error vae=exact: a "
        "strict component override of a lossy kernel against an exact budget is rejected "
        "with code lossy_kernel, naming the budget's flag.",
        _layer(head_size=128, name="decoder.mid_block.attentions.0"),
        SelectionConfig(component_backends={"vae": "sage_attn"}, attention_error={"vae": "exact"}),
        scope_state("vae", "sage_attn"),
        "cuda:sm90+flash_attn+sageattention",
        None,
        expect=rejects(
            "lossy_kernel",
            origin="component_override",
            error_contains=("is outside this layer's error budget", "--attention-error vae=exact"),
        ),
    ),
    Scenario(
        "precision-transformer-sage-admitted-by-facts-unmeasured",
        "Issue 34: a numeric budget (transformer=2e-2) admits the lossy sage_attn by its "
        "facts before it is measured; the precision record says lossy, how, the budget and "
        "that nothing was measured yet.",
        _layer(head_size=128, name="transformer_blocks.0.attn"),
        _budget("sage_attn", {"vae": "exact", "transformer": 2e-2}),
        scope_state("transformer"),
        "cuda:sm90+flash_attn+sageattention",
        None,
        expect=selects("sage_attn", origin="global_cli"),
    ),
    Scenario(
        "precision-transformer-sage-admitted-with-measurement",
        "Issue 34: the emulated SageAttention's measured error on the layer's input "
        "(relative L2 0.0369) is within the transformer's budget 5e-2: sage_attn is admitted, "
        "the precision record carrying the measurement.",
        _layer(head_size=128, name="transformer_blocks.0.attn"),
        _budget("sage_attn", {"vae": "exact", "transformer": 5e-2}),
        scope_state("transformer"),
        "cuda:sm90+flash_attn+sageattention",
        None,
        expect=selects("sage_attn", origin="global_cli"),
        measured_error=(_SAGE_SM90_MEASURED,),
    ),
    Scenario(
        "precision-transformer-sage-over-budget-rejected",
        "Issue 34: the same measurement (relative L2 0.0369) exceeds a transformer budget of "
        "2e-2; the operator's global sage_attn is strict for the transformer, so the layer is "
        "rejected with code error_over_budget and the measurement in the message.",
        _layer(head_size=128, name="transformer_blocks.0.attn"),
        _budget("sage_attn", {"vae": "exact", "transformer": 2e-2}),
        scope_state("transformer"),
        "cuda:sm90+flash_attn+sageattention",
        None,
        expect=rejects(
            "error_over_budget",
            origin="global_cli",
            error_contains=("relative L2 0.0369", "relative L2 <= 0.02"),
        ),
        measured_error=(_SAGE_SM90_MEASURED,),
    ),
    Scenario(
        "precision-text-encoder-sage-over-budget-falls-back",
        "Issue 34: under a global budget 2e-2 a text encoder (which allows global fallback) "
        "whose measured sage_attn error is over budget falls back to fa.",
        _layer(head_size=128, name="encoder.layer.0.attention"),
        _budget("sage_attn", {"*": 2e-2}),
        scope_state("text_encoder"),
        "cuda:sm90+flash_attn+sageattention",
        None,
        expect=selects("fa", "global backend fallback", origin="global_cli"),
        measured_error=(_SAGE_SM90_MEASURED,),
    ),
    Scenario(
        "precision-transformer-sage-admitted-from-results-file",
        "Issue 34: the measurement came from a calibration results file (source loaded, "
        "attnres calibrate --save / --load): replayed, the machine admits sage_attn within "
        "the budget 5e-2 again from the recorded figures.",
        _layer(head_size=128, name="transformer_blocks.0.attn"),
        _budget("sage_attn", {"transformer": 5e-2}),
        scope_state("transformer"),
        "cuda:sm90+flash_attn+sageattention",
        None,
        expect=selects("sage_attn", origin="global_cli"),
        measured_error=(attrs.evolve(_SAGE_SM90_MEASURED, source="loaded"),),
    ),
)

SCENARIOS = SCENARIOS + PRECISION_SCENARIOS


def scenario_by_name(name: str) -> Scenario:
    for scenario in SCENARIOS:
        if scenario.name == name:
            return scenario
    raise KeyError(name)


# =============================================================================
# The corpus on disk
# =============================================================================


@frozen
class CorpusChange:
    """What regenerating the corpus did (or would do), by scenario name."""

    new: tuple[str, ...] = ()
    changed: tuple[str, ...] = ()
    unchanged: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()

    def summary(self) -> str:
        lines = [
            f"golden traces: {len(self.new)} new, {len(self.changed)} changed, "
            f"{len(self.unchanged)} unchanged, {len(self.removed)} removed"
        ]
        for label, names in (
            ("new", self.new),
            ("changed", self.changed),
            ("removed", self.removed),
        ):
            lines += [f"  {label:<8}{name}.json" for name in names]
        return "\n".join(lines)


def corpus_status(
    directory: str | os.PathLike[str], scenarios: Iterable[Scenario] = SCENARIOS
) -> tuple[CorpusChange, dict[str, str]]:
    """Compare ``directory`` with what the scenarios render; no file is touched.

    Returns the change set and the rendered text of every scenario by name.
    """
    folder = Path(directory)
    rendered = {s.name: s.render() for s in scenarios}
    existing = {p.stem for p in folder.glob("*.json")} if folder.is_dir() else set()
    new, changed, unchanged = [], [], []
    for name, text in sorted(rendered.items()):
        path = folder / f"{name}.json"
        if name not in existing:
            new.append(name)
        elif path.read_bytes() != text.encode("utf-8"):
            changed.append(name)
        else:
            unchanged.append(name)
    removed = sorted(existing - set(rendered))
    return CorpusChange(tuple(new), tuple(changed), tuple(unchanged), tuple(removed)), rendered


def update_corpus(
    directory: str | os.PathLike[str], scenarios: Iterable[Scenario] = SCENARIOS
) -> CorpusChange:
    """Regenerate ``directory`` from the scenarios: write new and changed files
    atomically, delete files no scenario produces; unchanged files are not touched."""
    folder = Path(directory)
    change, rendered = corpus_status(folder, scenarios)
    for name in (*change.new, *change.changed):
        atomic_write_text(folder / f"{name}.json", rendered[name])
    for name in change.removed:
        (folder / f"{name}.json").unlink()
    return change
