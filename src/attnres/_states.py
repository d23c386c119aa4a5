"""The resolution machine's vocabulary: its states, events, origins, checks,
reasons and failure codes. The rules that connect them live in
:mod:`attnres.machine` (the transition table); this module only names things,
so that the trace records can be typed without importing the machine.
"""

from __future__ import annotations

import enum

__all__ = ["Check", "Code", "Event", "Origin", "Reason", "State", "Verdict"]


class _StrEnum(str, enum.Enum):
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


class Reason(_StrEnum):
    GLOBAL_BACKEND_FALLBACK = "global backend fallback"
    PLATFORM_DEFAULT_FALLBACK = "platform default fallback"
    DENSE_CROSS_ATTENTION_FALLBACK = "dense cross-attention fallback"
    COMPONENT_CONSTRAINT = "component constraint"
    MEASURED_FASTER = "measured faster"


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
    REQUIREMENT_UNMET = "requirement_unmet"
    NO_COMPATIBLE_BACKEND = "no_compatible_backend"


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
