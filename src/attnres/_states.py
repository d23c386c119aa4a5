"""The resolution machine's vocabulary: its states, events, origins, checks,
reasons and failure codes. The rules that connect them live in
:mod:`attnres.machine` (the transition table); this module only names things,
so that the trace records can be typed without importing the machine.
"""

from __future__ import annotations

import enum

__all__ = [
    "Check",
    "Code",
    "Event",
    "KernelSource",
    "Origin",
    "PackageStatus",
    "Reason",
    "RouteKind",
    "SiteCode",
    "State",
    "Status",
    "Verdict",
    "optional_code",
    "optional_reason",
    "to_code",
    "to_origin",
    "to_site_code",
    "to_status",
]


class _StrEnum(str, enum.Enum):
    # A member equals its value (str.__eq__), so it hashes like it too: str's C
    # hash, not Enum's Python-level hash of the member's name. The machine looks
    # its transitions up by state and event, so this is on every resolution's path.
    __hash__ = str.__hash__

    def __str__(self) -> str:
        return str(self.value)


class State(_StrEnum):
    ORIGIN_DETECTION = "origin_detection"
    REQUESTED = "requested"
    COMPONENT_DEFAULT = "component_default"
    PLATFORM_DEFAULT = "platform_default"
    SUPPORTED_SET = "supported_set"
    SELECTED = "selected"
    REJECTED = "rejected"
    #: autotune: the candidates of a selected automatic decision are timed
    MEASURING = "measuring"


class Event(_StrEnum):
    REQUEST_FOUND = "request_found"
    NOTHING_REQUESTED = "nothing_requested"
    SINGLE_SUPPORTED = "single_supported"
    ACCEPTED = "accepted"
    STRICT_FAILURE = "strict_failure"
    GLOBAL_FALLBACK = "global_fallback"
    PREFERENCE_FALLBACK = "preference_fallback"
    SPARSE_CROSS_FALLBACK = "sparse_cross_fallback"
    #: issue 30: a relaxed request on a layer whose route runs only its own
    #: softmax attention written by hand
    BY_HAND_FALLBACK = "by_hand_fallback"
    CANDIDATE_FAILED = "candidate_failed"
    EXHAUSTED = "exhausted"
    #: autotune: a selected automatic decision is measured against its candidates
    MEASURE = "measure"
    #: autotune: a candidate agreed with the incumbent and beat it by more than the margin
    MEASURED_FASTER = "measured_faster"
    #: autotune: no candidate beat the incumbent by more than the margin
    INCUMBENT_KEPT = "incumbent_kept"


class Origin(_StrEnum):
    REQUEST = "request"
    LAYER = "layer"
    FORCED = "forced"
    ROLE_OVERRIDE = "role_override"
    COMPONENT_OVERRIDE = "component_override"
    GLOBAL_CLI = "global_cli"
    GLOBAL_ENV = "global_env"
    GLOBAL_PREFERENCE = "global_preference"
    LAYER_DEFAULT = "layer_default"
    NONE = "none"


class Check(_StrEnum):
    KNOWN = "known"
    AVAILABLE = "available"
    PLATFORM = "platform"
    ROLE = "role"
    SUPPORTED = "supported"
    REQUIREMENTS = "requirements"
    #: issue 24: the layer's sequence-parallel layout (run only when it has one)
    LAYOUT = "layout"
    #: issue 34: a lossy kernel against the layer's error budget (run only when
    #: the layer has a budget: ``SelectionConfig.attention_error``)
    PRECISION = "precision"


class Reason(_StrEnum):
    GLOBAL_BACKEND_FALLBACK = "global backend fallback"
    PLATFORM_DEFAULT_FALLBACK = "platform default fallback"
    DENSE_CROSS_ATTENTION_FALLBACK = "dense cross-attention fallback"
    COMPONENT_CONSTRAINT = "component constraint"
    #: issue 30: the layer's route runs only the site's own code, which computes
    #: softmax attention by hand (no kernel is offered there)
    WRITTEN_BY_HAND = "softmax attention written by hand"
    MEASURED_FASTER = "measured faster"
    # issue 23, the ``sglang`` profile: SGLang records a role override's
    # divergence from the component backend as an explained selection
    SELF_ATTENTION_OVERRIDE = "self-attention override"
    CROSS_ATTENTION_OVERRIDE = "cross-attention override"


class Code(_StrEnum):
    """Machine-readable codes of failed checks and of rejections."""

    UNKNOWN_BACKEND = "unknown_backend"
    PACKAGE_MISSING = "package_missing"
    PACKAGE_BROKEN = "package_broken"
    PLATFORM_KIND = "platform_kind"
    COMPUTE_CAPABILITY = "compute_capability"
    ARCHITECTURE = "architecture"
    TORCH_VERSION = "torch_version"
    DTYPE = "dtype"
    HEAD_SIZE = "head_size"
    SPARSE_CROSS_ATTENTION = "sparse_cross_attention"
    NOT_IN_SUPPORTED_SET = "not_in_supported_set"
    #: the backend only stands in for the layer's supported set, and the layer's
    #: route (``LayerSpec.exact_route``) runs exactly the backends the set names
    NOT_ON_ROUTE = "not_on_route"
    REQUIREMENT_UNMET = "requirement_unmet"
    #: the layer will run, and this process has no kernel for the backend
    NO_KERNEL = "no_kernel"
    #: issue 23, the ``sglang`` profile: the host framework's platform does not
    #: resolve the backend here (an observed fact, ``Platform.host``)
    HOST_PLATFORM = "host_platform"
    NO_COMPATIBLE_BACKEND = "no_compatible_backend"
    #: issue 24: a ring layout needs a kernel that returns the softmax log-sum-exp
    NO_LSE = "no_lse"
    #: issue 24: a Ulysses layout needs head counts divisible by its degree
    HEADS_NOT_DIVISIBLE = "heads_not_divisible"
    #: issue 24: the layer needs what attnres's sequence-parallel layouts do not do
    #: (attention masks; a sliding window across ring blocks)
    LAYOUT_UNSUPPORTED = "layout_unsupported"
    #: issue 35: a head-padded Ulysses layout would spend at least half its
    #: attention on padding (``attnres.layout.MAX_PAD_COST``)
    PADDING_TOO_COSTLY = "padding_too_costly"
    #: issue 35: an AllGather-KV layout on a causal layer (each query shard would
    #: need a bottom-right-aligned mask over the gathered keys; vllm-omni#4968's
    #: AllGather-KV is "only valid for causal=False attention")
    ALLGATHER_CAUSAL = "allgather_causal"
    #: issue 34: the kernel is lossy (or declares no precision facts) and the
    #: layer's error budget is ``exact``
    LOSSY_KERNEL = "lossy_kernel"
    #: issue 34: the kernel's measured error on the layer's own inputs exceeds
    #: the layer's numeric error budget
    ERROR_OVER_BUDGET = "error_over_budget"


class ScopeCode(_StrEnum):
    """Why a component scope's overrides do not explain its layers (SPEC 3.6;
    the checks are ``attnres.machine.SCOPE_CHECKS``)."""

    #: a layer runs another backend than the component's, with no recorded reason
    #: and no role override
    UNEXPLAINED = "override_unexplained"
    #: the component backend was requested, and the scope built no attnres layer
    NO_LAYER = "override_without_layers"
    #: the component backend was rejected for its layers, and no layer runs it
    REJECTED = "override_rejected"
    #: the component backend ran on none of the scope's layers
    NOT_APPLIED = "override_not_applied"
    #: a role override's role built no layer that it governed
    ROLE_NO_LAYER = "role_override_without_layers"
    #: a role override ran on none of the layers it governed
    ROLE_NOT_APPLIED = "role_override_not_applied"


class KernelSource(_StrEnum):
    """Where the kernel that runs a backend comes from, in this process."""

    #: attnres's own adapter (``BackendSpec.kernel``, built on first use)
    BUILTIN = "builtin"
    #: a kernel given to :func:`attnres.kernels.register_kernel`
    REGISTERED = "registered"
    #: no kernel: a layer that will run cannot be handed this backend
    NONE = "none"


class Status(_StrEnum):
    """How a resolution ended."""

    SELECTED = "selected"
    REJECTED = "rejected"
    # issue 19 (additive): integration sites that are not resolved at plan time
    #: an attention site whose head facts only its first call tells ("decided at
    #: first call"); it is resolved then, through the machine, and traced
    PENDING = "pending"
    #: a module attnres found but leaves on its own code path, with the reason
    #: (attention that is not softmax attention; an unclassified site of a
    #: component that may fall back)
    UNGOVERNED = "ungoverned"


class SiteCode(_StrEnum):
    """Why an integration site is rejected when no check of the machine says so
    (a site the machine rejects carries the machine's :class:`Code`)."""

    #: its attention call could not be classified, in a strict component
    UNCLASSIFIED = "unclassified"
    # (a stand-in its route cannot run is the machine's ``not_on_route``: the
    # site's spec carries its route as ``LayerSpec.exact_route``)


def to_site_code(value: Code | SiteCode | str) -> Code | SiteCode:
    """An attrs converter: a site error's code as its member (the machine's
    :class:`Code`, or a :class:`SiteCode`)."""
    if type(value) is Code or type(value) is SiteCode:
        return value
    return SiteCode(value) if value in SiteCode._value2member_map_ else Code(value)


class RouteKind(_StrEnum):
    """How an integration site's kernel is put in place (issue 30): code
    dispatches on this, never on the route's words (``Site.route`` is for people)."""

    #: the generic route: the site's own SDPA calls run the kernel decided per
    #: call signature
    INTERCEPT = "intercept"
    #: transformers' attention interface: the config names the function it runs
    INTERFACE = "interface"
    #: the site runs one kernel its code names (a host's dispatcher pinned to a
    #: backend, a kernel its code calls, torch's own MultiheadAttention path)
    PIN = "pin"
    #: the site's own code, untouched (not softmax attention, softmax attention
    #: written by hand -- issue 30: no kernel is offered there --, or nothing routes it)
    OWN_CODE = "own code"


class ReplayStatus(_StrEnum):
    """What replaying one trace file found (``attnres replay``)."""

    OK = "ok"
    DIFF = "diff"
    INVALID = "invalid"


class PlanStatus(_StrEnum):
    """Whether every layer of a planned pipeline was served."""

    OK = "ok"
    REJECTED = "rejected"


class PackageStatus(_StrEnum):
    """What probing an optional kernel package found."""

    PRESENT = "present"
    MISSING = "missing"
    BROKEN = "broken"


def optional_reason(value: Reason | str | None) -> Reason | None:
    """An attrs converter: ``None`` stays ``None``, a reason text becomes the member."""
    # a member passes as it is (the machine's records: no enum lookup per record)
    return value if value is None or type(value) is Reason else Reason(value)


def optional_code(value: Code | str | None) -> Code | None:
    """An attrs converter: ``None`` stays ``None``, a code name becomes the member."""
    return value if value is None or type(value) is Code else Code(value)


def to_code(value: Code | str) -> Code:
    """An attrs converter: a code name becomes the member (a member passes as it is)."""
    return value if type(value) is Code else Code(value)


def to_status(value: Status | str) -> Status:
    """An attrs converter: a status text becomes the member (a member passes as it is)."""
    return value if type(value) is Status else Status(value)


def to_origin(value: Origin | str) -> Origin:
    """An attrs converter: an origin text becomes the member (a member passes as it is)."""
    return value if type(value) is Origin else Origin(value)


class Verdict(_StrEnum):
    """What the tuner concluded about one measured candidate (docs/trace-format.md)."""

    #: the machine's choice, the reference every other output is compared with
    INCUMBENT = "incumbent"
    #: agreed, and beat the incumbent by more than the margin, fastest of those
    CHOSEN = "chosen"
    #: agreed, beat the incumbent by more than the margin, but another was faster
    OUTPACED = "outpaced"
    #: agreed, but did not beat the incumbent by more than the margin
    WITHIN_MARGIN = "within_margin"
    #: its output deviated from the incumbent's beyond the tolerance: never chosen
    DISAGREES = "disagrees"
    #: it raised on the real inputs: skipped, the error recorded
    RAISED = "raised"
    #: issue 34: its relative L2 error against a float64 reference exceeds the
    #: layer's numeric error budget: never chosen
    OVER_BUDGET = "over_budget"
