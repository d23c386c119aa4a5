"""The ``vllm_omni`` selection profile: vLLM-Omni's diffusion rules as tables (issue 36).

``SelectionConfig(profile="vllm_omni")`` makes :func:`attnres.machine.run_machine`
decide the way vLLM-Omni 0.30.0's ``get_attn_backend_for_role(role, head_size,
attention_config, role_category, allow_trtllm_default)``
(``vllm_omni/diffusion/attention/selector.py``) does.
The profile is one value, :data:`VLLM_OMNI` (an :class:`attnres._profile.Profile`,
which says what each field means); ``run_machine`` walks it as it walks
attnres's own contract and SGLang's (issue 33: one rule engine). Its rows:
which ``AttentionConfig`` entry wins (:data:`ORIGIN_ROWS`, vLLM-Omni's order;
``"auto"`` is the absence of a row: ``AttentionConfig`` drops it at
construction), whether a candidate that cannot run the layer may be replaced
(:data:`FALLBACK_ROWS`: vLLM-Omni has no fallback; where its platform would
answer with a class that states it cannot take the layer's head size, which
vLLM-Omni otherwise meets as a crash when the layer is built or run, attnres
does what the table says and records why), the candidates (``_candidates``)
and the words vLLM-Omni logs for each origin (:data:`SOURCES`). The plugin
writes the configured entries into the input as the layer's backend, the
scope's backend (the scope's component is the role category) and
``SelectionConfig.global_backend``.

The platform is observed, never enumerated: vLLM-Omni's per-platform chains
(``current_omni_platform.get_diffusion_attn_backend_cls``) are read through its
own ``_cached_get_backend_cls`` and recorded as
:class:`~attnres.platform.HostResolution` facts, so a trace replays without
vLLM-Omni. Outside the plugin no fact is observed: the profile rejects with
:data:`UNOBSERVED` and names how to supply them (:data:`HOST_FACTS`).
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter
from typing import Any, Final

from attnres._profile import (
    UNOBSERVED,
    Evaluation,
    Given,
    Guard,
    GuardFacts,
    OriginRow,
    Profile,
    Tried,
    first_guard,
    host_facts,
    requested_by,
)
from attnres._states import Check, Code, Event, Origin, State
from attnres.backends import Backend, BackendOption, OptionValue
from attnres.records import Failure, TraceInput

__all__ = [
    "FALLBACK_ROWS",
    "HOST_FACTS",
    "OPTIONS",
    "ORIGIN_ROWS",
    "REPLACEMENT",
    "SOURCES",
    "UNOBSERVED",
    "VLLM_OMNI",
    "VLLM_OMNI_VERSION",
    "WHY",
]

#: The vLLM-Omni release these rows were read from.
VLLM_OMNI_VERSION: Final = "0.30.0"

#: vLLM-Omni's precedence (``AttentionConfig.resolve_with_source``): the first
#: row whose backend is set wins; none set: the platform's default. Every entry
#: is the operator's (explicit); the fallback rows say it is strict.
ORIGIN_ROWS: Final[tuple[OriginRow, ...]] = (
    OriginRow(Origin.LAYER, "attention_config.per_role[role]", True, attrgetter("backend")),
    OriginRow(
        Origin.COMPONENT_OVERRIDE,
        "attention_config.per_role[role_category] (role_category fallback)",
        True,
        lambda inp: None if inp.scope is None else inp.scope.backend,
    ),
    OriginRow(
        Origin.GLOBAL_CLI,
        "attention_config.default",
        True,
        attrgetter("config.global_backend"),
    ),
)

#: What vLLM-Omni logs as the source of each origin (``{role}``, ``{category}``:
#: the call's role and role category, as ``repr``).
SOURCES: Final[dict[Origin, str]] = {
    Origin.LAYER: "attention_config.per_role[{role}]",
    Origin.COMPONENT_OVERRIDE: "attention_config.per_role[{category}] (role_category fallback)",
    Origin.GLOBAL_CLI: "attention_config.default",
    Origin.NONE: "platform default",
}

#: Whether the served class that cannot run the layer may be replaced, keyed by
#: "a backend was configured" (the first row that holds decides; the origin
#: record names it): a configured one is refused, typed, before the layer is
#: built; the platform's default falls back to :data:`REPLACEMENT`.
FALLBACK_ROWS: Final[tuple[Guard, ...]] = (
    Guard(
        "a configured backend (per_role or default)",
        lambda f: f.requested,
        Event.STRICT_FAILURE,
    ),
    Guard("the platform's default", lambda f: True, Event.PREFERENCE_FALLBACK),
)

#: Why each fallback row decides as it does (a rejection's message says so).
WHY: Final[dict[Event, str]] = {
    Event.STRICT_FAILURE: (
        "the operator chose it: vLLM-Omni would build the layer and fail at its first "
        "forward; attnres refuses at selection with the class's own head sizes"
    ),
    Event.PREFERENCE_FALLBACK: (
        "nobody chose it: the platform picked it from a name and a head size "
        "(vllm-omni#3079, #3121); TORCH_SDPA takes every head size"
    ),
}

#: What replaces a platform default the layer cannot run: it takes every head size.
REPLACEMENT: Final = Backend("torch_sdpa")

#: How the facts this profile decides from are supplied (a rejection for a
#: missing one says so).
HOST_FACTS: Final = host_facts("vllm_omni", "vLLM-Omni", "docs/vllm-omni.md")


def _candidates(stage: State, given: Given, requested: Backend | None) -> Sequence[Backend | None]:
    """The configured backend; nothing configured, the platform's own pick and --
    only where the platform served a class (a refusal is the answer, never
    replaced) -- TORCH_SDPA."""
    inp = given.inp
    if stage is State.REQUESTED:
        return (requested,)
    if stage is not State.PLATFORM_DEFAULT:
        return ()
    fact = inp.platform.host_resolution("")
    if fact is None or fact.served is None:
        return (None,)
    return (None, REPLACEMENT)


def _evaluate(profile: Profile, candidate: Backend | None, inp: TraceInput, _: bool) -> Evaluation:
    """The checks of one candidate, on the class vLLM-Omni's platform serves it by
    (its observed :class:`~attnres.platform.HostResolution`): ``platform``, then
    ``requirements`` (the class's own ``supports_head_size``)."""
    fact = inp.platform.host_resolution("" if candidate is None else candidate.name)
    if fact is None or fact.served is None:
        error = UNOBSERVED if fact is None else str(fact.error)
        return candidate, ((Check.PLATFORM, (Failure(Code.HOST_PLATFORM, error),)),)
    served = Backend(fact.served)
    missing = tuple(
        Failure(Code.REQUIREMENT_UNMET, f"{served.name} cannot take {m}") for m in fact.missing
    )
    return served, ((Check.PLATFORM, ()), (Check.REQUIREMENTS, missing))


def _reject(
    profile: Profile, inp: TraceInput, tried: Sequence[Tried], refused: bool
) -> tuple[str, str]:
    """The first failure: the platform's refusal (vLLM-Omni's error, unchanged), or
    the first class that cannot take the layer, with why its row refuses it."""
    for _, _, results in tried:
        for _, failures in results:
            if not failures:
                continue
            first = failures[0]
            if first.code is Code.REQUIREMENT_UNMET:
                facts = GuardFacts(requested=requested_by(profile, inp)[1] is not None)
                why = WHY[first_guard(profile.request_failure, facts).event]
                return f"{first.message} ({why})", str(first.code)
            if first.message == UNOBSERVED and profile.host_facts:
                return f"{first.message}: {profile.host_facts}", str(first.code)
            return first.message, str(first.code)
    return "No compatible attention backend is available", str(Code.NO_COMPATIBLE_BACKEND)


#: The ``vllm_omni`` profile (``SelectionConfig(profile="vllm_omni")``).
VLLM_OMNI: Final = Profile(
    name="vllm_omni",
    origins=ORIGIN_ROWS,
    nothing_requested="nothing configured: the platform default",
    request_failure=FALLBACK_ROWS,
    states_fallback=True,
    sparse=lambda inp, backend: False,  # no row reads it: vLLM-Omni has no sparse rule
    candidates=_candidates,
    evaluate=_evaluate,
    reject=_reject,
    host_facts=HOST_FACTS,
    source=f"vLLM-Omni {VLLM_OMNI_VERSION}'s diffusion selector (`get_attn_backend_for_role`)",
)


# -- vLLM-Omni's typed per-backend options (issue 36) ---------------------------

_DATA: Final = f"vllm_omni/diffusion/data.py ({VLLM_OMNI_VERSION})"
#: The dataclass of ``_DATA`` each dotted prefix names (no prefix: ``AttentionSpec``).
_SPECS: Final = {
    "skip_softmax": "SkipSoftmaxSpec",
    "quant": "AttnQuantSpec",
    "block_sparse": "BlockSparseSpec",
}


def _field(
    name: str, kind: str, default: OptionValue, note: str = "", **bounds: Any
) -> BackendOption:
    """The typed field ``name`` of vLLM-Omni's spec, citing where it is declared."""
    prefix, _, attr = name.rpartition(".")
    source = f"{_DATA} {_SPECS.get(prefix, 'AttentionSpec')}.{attr}{note}"
    return BackendOption(name, kind, default, source, **bounds)


_QUANT_DTYPES: Final = ("bfloat16", "float16", "fp8_e4m3", "int8")
_QUANT: Final = (
    _field("quant.dtype_qk", "str", None, choices=_QUANT_DTYPES, nullable=True),
    _field("quant.dtype_vo", "str", None, choices=_QUANT_DTYPES, nullable=True),
    _field("quant.q_block_size", "int", 1, choices=(1, 4, 16)),
    _field("quant.k_block_size", "int", 16, choices=(1, 4, 16)),
    _field("quant.flashinfer_backend", "str", None, nullable=True),
)

#: The typed options of vLLM-Omni's ``AttentionSpec``, as attnres backend options
#: of the backend each is valid for (by ``DiffusionAttentionBackendEnum`` name):
#: dotted names are the spec's nested fields as vLLM-Omni's config spells them
#: (``{"skip_softmax": {"threshold": 0.1}}`` is ``skip_softmax.threshold``), the
#: ranges and choices are the ones its ``__post_init__`` checks. The plugin
#: registers them on the specs of those backends and converts the winning
#: entry's options into ``LayerSpec.backend_options``, checked by attnres's
#: option checks and recorded in the decision's trace.
OPTIONS: Final[dict[str, tuple[BackendOption, ...]]] = {
    "TRTLLM_ATTN": (
        _field("skip_softmax.target_sparsity", "float", None, minimum=0, maximum=1, nullable=True),
        _field("skip_softmax.threshold", "float", None, minimum=0, nullable=True),
        _field("skip_softmax.disabled_until_timestep", "float", 0.0, minimum=0, maximum=1),
        *_QUANT,
    ),
    "FLASHINFER_ATTN": _QUANT,
    "FASTVIDEO_VSA": (_field("fastvideo_vsa_topk", "int", None, minimum=1, nullable=True),),
    "RAINFUSION_ATTN": (
        _field("block_sparse.sparsity", "float", 0.8, minimum=0, maximum=1),
        _field("block_sparse.start_step", "int", 0, minimum=0),
        _field("block_sparse.end_step", "int", 0, minimum=0),
        _field(
            "block_sparse.precision",
            "str",
            "bf16",
            " (RainFusionPrecision)",
            choices=("bf16", "fp8", "mix"),
        ),
        _field(
            "block_sparse.skip_layers",
            "str",
            None,
            " (an index selector; a list is written comma-separated)",
            nullable=True,
        ),
    ),
}
