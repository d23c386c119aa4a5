"""The resolver's inputs: what a layer is and what the operator asked for.

All of them are frozen attrs classes with validators; backends and sets may be
given as :class:`~attnres.backends.Backend` or as strings, dtypes as strings
(``"bf16"``, ``"bfloat16"``) or ``torch.dtype``. A bad value is a
``ValueError`` whose message starts with the field's name.
"""

from __future__ import annotations

import difflib
import operator
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Final

import attrs
from attrs import field, frozen

from attnres._vocab import (
    CausalAlignment,
    MaskKind,
    Requirement,
    Role,
    normalize_component,
    normalize_dtype,
)
from attnres.backends import Backend, BackendOptions, normalize_backend_options
from attnres.errors import InvalidArgumentError, UnknownBackendError
from attnres.layout import SequenceLayout

__all__ = ["ENV_VAR", "LayerSpec", "Requirements", "Role", "SelectionConfig", "split_component_key"]

#: The environment variable that sets the global backend when the flag is absent.
ENV_VAR = "ATTNRES_ATTENTION_BACKEND"

#: Where :func:`attnres.cli.add_selection_arguments` leaves the selection flags
#: in an argparse namespace (:meth:`SelectionConfig.from_args` reads them).
DEST_BACKEND = "attention_backend"
DEST_COMPONENTS = "attention_backend_components"
DEST_EXPLICIT = "attention_backend_explicit"
DEST_AUTOTUNE = "autotune"
DEST_AUTOTUNE_MIN = "autotune_min_elements"
#: issue 34: ``--attention-error`` values, as typed (a list of strings)
DEST_ATTENTION_ERROR = "attention_error"

#: attrs metadata of a field that a trace does not record (see trace.field_names)
_NOT_IN_TRACE: dict[str, bool] = {"trace": False}


def _parse_backend(value: Backend | str, what: str) -> Backend:
    try:
        return Backend.parse(value)
    except UnknownBackendError as exc:
        raise UnknownBackendError(f"{what}: {exc}", exc.name, exc.suggestion) from None
    except TypeError as exc:
        raise InvalidArgumentError(f"{what}: {exc}") from None


def optional_backend(what: str) -> Callable[[Backend | str | None], Backend | None]:
    def convert(value: Backend | str | None) -> Backend | None:
        return None if value is None else _parse_backend(value, what)

    return convert


def _backend_set_of(
    what: str,
) -> Callable[[Iterable[Backend | str] | str | None], frozenset[Backend] | None]:
    """The converter of a set of backends named ``what`` in its messages
    (``supported``, ``preferred``: issue 32 item 17)."""

    def convert(value: Iterable[Backend | str] | str | None) -> frozenset[Backend] | None:
        if value is None:
            return None
        if type(value) is frozenset and value and all(type(v) is Backend for v in value):
            return value  # already the field's form (Backend.parse passes a Backend as it is)
        if isinstance(value, (str, Backend)):
            value = [value]
        if not isinstance(value, Iterable):
            raise InvalidArgumentError(f"{what}: expected a set of backend names, got {value!r}")
        out = frozenset(_parse_backend(v, what) for v in value)
        if not out:
            raise InvalidArgumentError(
                f"{what}: an empty set admits no backend; pass None for a layer without a "
                f"{what}-set constraint"
            )
        return out

    return convert


_SUPPORTED_SET = _backend_set_of("supported")
_PREFERRED_SET = _backend_set_of("preferred")


def _backend_set(value: Iterable[Backend | str] | str | None) -> frozenset[Backend] | None:
    return _SUPPORTED_SET(value)


def _preferred_set(value: Iterable[Backend | str] | str | None) -> frozenset[Backend] | None:
    return _PREFERRED_SET(value)


def _required_backend(value: Backend | str | None) -> Backend | None:
    return None if value is None else _parse_backend(value, "required")


#: The largest head size attnres accepts. Real attention layers use 32 to 576;
#: anything past this is a typo (or a unit mix-up), not a layer.
MAX_HEAD_SIZE = 16384


def _positive_head_size(value: Any) -> int:
    if type(value) is int and 0 < value <= MAX_HEAD_SIZE:
        return value
    # any integer type (numpy's, torch's) that offers __index__; never a bool
    if isinstance(value, bool):
        raise InvalidArgumentError(f"head_size: expected a positive integer, got {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        raise InvalidArgumentError(
            f"head_size: expected a positive integer, got {value!r}"
        ) from None
    if number < 1:
        raise InvalidArgumentError(f"head_size: must be at least 1, got {number}")
    if number > MAX_HEAD_SIZE:
        shown = str(number) if number < 10**30 else f"a number of {len(str(number))} digits"
        raise InvalidArgumentError(
            f"head_size: must be at most {MAX_HEAD_SIZE} (real layers use 32 to 576), got {shown}"
        )
    return number


def _default_backend(value: Backend | str | None) -> Backend | None:
    return None if value is None else _parse_backend(value, "default")


def _global_backend(value: Backend | str | None) -> Backend | None:
    return None if value is None else _parse_backend(value, "global_backend")


def _forced_backend(value: Backend | str | None) -> Backend | None:
    return None if value is None else _parse_backend(value, "forced_backend")


def _role(value: Role | str) -> Role:
    return Role.parse(value)


def _name(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidArgumentError(f"name: expected a string, got {value!r}")
    return value


def _exact_route(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise InvalidArgumentError(
            f"exact_route: expected the route's name (a string), got {value!r}"
        )
    return value


def _route_needs_supported(instance: Any, _: Any, value: str | None) -> None:
    if value is not None and instance.supported is None:
        raise InvalidArgumentError(
            f"exact_route: route {value!r} runs exactly the backends of a supported set, "
            f"and this layer has none (supported=None admits any backend)"
        )


def _is_bool(_: Any, attribute: Any, value: Any) -> None:
    # strict on purpose: bool("no") is True, and a flag that silently turns on
    # is worse than an error
    if not isinstance(value, bool):
        raise InvalidArgumentError(f"{attribute.name}: expected True or False, got {value!r}")


#: The requirements in their canonical order, with the field each one reads
#: (iterating the enum itself costs more than the check, on every cold resolution).
_REQUIREMENT_FIELDS: tuple[tuple[Requirement, str], ...] = tuple((r, r.value) for r in Requirement)

#: What a misspelt requirement is matched against: the names, their words, and
#: the short names ``attnres backends`` prints.
_REQUIREMENT_HINTS: dict[str, str] = {
    **{r.value: r.value for r in Requirement},
    "mask": "attn_mask",
    "masks": "attn_mask",
    "attention_mask": "attn_mask",
    "varlen": "packed_varlen",
    "packed": "packed_varlen",
    "grouped_query": "gqa",
    # mask kinds (issue 22): a name in a requirement list sets Requirements.mask
    **{k.value: k.value for k in MaskKind if k not in (MaskKind.NONE, MaskKind.ANY)},
    "padding": "key_padding",
    "key_padding_mask": "key_padding",
    "bias": "additive",
    # causal alignment: sets Requirements.causal_alignment (and causal)
    "bottom_right": "bottom_right",
}

#: The requirement-list names that choose a mask kind, and the one for the alignment.
_MASK_NAMES: dict[str, MaskKind] = {
    k.value: k for k in MaskKind if k not in (MaskKind.NONE, MaskKind.ANY)
}
_BOTTOM_RIGHT = CausalAlignment.BOTTOM_RIGHT.value


def _mask_kind(value: MaskKind | str) -> MaskKind:
    try:
        return MaskKind(value)
    except ValueError:
        valid = ", ".join(k.value for k in MaskKind)
        raise InvalidArgumentError(f"mask: unknown mask kind {value!r}; valid: {valid}") from None


def _alignment(value: CausalAlignment | str) -> CausalAlignment:
    try:
        return CausalAlignment(value)
    except ValueError:
        valid = ", ".join(a.value for a in CausalAlignment)
        raise InvalidArgumentError(
            f"causal_alignment: unknown alignment {value!r}; valid: {valid}"
        ) from None


@frozen(cache_hash=True)
class Requirements:
    """The semantic features a layer needs from its kernel.

    ``mask`` names the kind of mask tensor the layer passes (issue 22,
    docs/masks.md); ``attn_mask`` is true exactly when it is not ``none``, and
    0.2's ``attn_mask=True`` alone keeps meaning "an arbitrary boolean or
    additive mask" (``MaskKind.ANY``). ``causal_alignment`` says where a causal
    mask's diagonal sits when query and key lengths differ.
    """

    causal: bool = field(default=False, validator=_is_bool)
    attn_mask: bool = field(default=False, validator=_is_bool)
    packed_varlen: bool = field(default=False, validator=_is_bool)
    gqa: bool = field(default=False, validator=_is_bool)
    dropout: bool = field(default=False, validator=_is_bool)
    backward: bool = field(default=False, validator=_is_bool)
    custom_scale: bool = field(default=False, validator=_is_bool)
    softcap: bool = field(default=False, validator=_is_bool)
    sliding_window: bool = field(default=False, validator=_is_bool)
    #: issue 19: written to a trace only when set (every older trace keeps its bytes)
    sinks: bool = field(default=False, validator=_is_bool)
    #: issue 19: the call returns its attention weights; written only when set
    weights: bool = field(default=False, validator=_is_bool)
    mask: MaskKind = field(default=MaskKind.NONE, converter=_mask_kind)
    causal_alignment: CausalAlignment = field(
        default=CausalAlignment.TOP_LEFT, converter=_alignment
    )

    def __attrs_post_init__(self) -> None:
        # attn_mask and mask say one thing: a kind implies a mask; a bare
        # attn_mask=True (0.2) is the arbitrary kind
        if self.mask is MaskKind.NONE and self.attn_mask:
            object.__setattr__(self, "mask", MaskKind.ANY)
        elif self.mask is not MaskKind.NONE and not self.attn_mask:
            object.__setattr__(self, "attn_mask", True)

    @property
    def extended(self) -> bool:
        """Whether these requirements say more than a 0.2 trace can (a mask kind
        or an alignment): a trace of them needs schema version 4."""
        return self.mask not in (MaskKind.NONE, MaskKind.ANY) or (
            self.causal_alignment is not CausalAlignment.TOP_LEFT
        )

    @property
    def mask_kind(self) -> str:
        """The layer's mask need in words: ``none``, ``causal``, ``key padding``,
        ``causal with key padding``, ``boolean``, ``additive``, ...; a causal one
        says its alignment when it is bottom-right."""
        kind = {
            MaskKind.NONE: "",
            MaskKind.KEY_PADDING: "key padding",
            MaskKind.BOOLEAN: "boolean mask",
            MaskKind.ADDITIVE: "additive mask",
            MaskKind.ANY: "boolean or additive mask",
        }[self.mask]
        if not self.causal:
            return kind or "none"
        causal = (
            "causal"
            if self.causal_alignment is CausalAlignment.TOP_LEFT
            else ("causal (bottom-right)")
        )
        return f"{causal} with {kind}" if kind else causal

    def needed(self) -> tuple[Requirement, ...]:
        """The requirements that are on, in the canonical order."""
        return tuple(r for r, name in _REQUIREMENT_FIELDS if getattr(self, name))

    @classmethod
    def of(
        cls,
        value: Requirements | Iterable[Requirement | str] | None,
        *,
        field: str = "requirements",
    ) -> Requirements:
        """From a ``Requirements``, ``None``, or names such as ``["causal", "gqa"]``.

        ``field`` is how the caller's user wrote the field (``requires`` in a
        pipeline file, ``--requires`` on the command line), for the messages.
        """
        if value is None:
            return _NO_REQUIREMENTS if cls is Requirements else cls()
        if isinstance(value, Requirements):
            return value
        if isinstance(value, str):
            value = [v for v in value.split(",") if v.strip()]
        names: dict[str, Any] = {}
        for item in value:
            key = item.value if isinstance(item, Requirement) else str(item).strip().lower()
            if key in _MASK_NAMES:
                if names.get("mask", _MASK_NAMES[key]) is not _MASK_NAMES[key]:
                    raise InvalidArgumentError(
                        f"{field}: two mask kinds, {names['mask'].value!r} and {key!r}; a "
                        f"layer passes one kind of mask"
                    )
                names["mask"] = _MASK_NAMES[key]
                continue
            if key == _BOTTOM_RIGHT:
                names["causal"] = True
                names["causal_alignment"] = CausalAlignment.BOTTOM_RIGHT
                continue
            try:
                names[Requirement(key).value] = True
            except ValueError:
                valid = ", ".join([r.value for r in Requirement] + [*_MASK_NAMES, _BOTTOM_RIGHT])
                close = difflib.get_close_matches(key, list(_REQUIREMENT_HINTS), n=1, cutoff=0.6)
                hint = f" (did you mean {_REQUIREMENT_HINTS[close[0]]!r}?)" if close else ""
                raise InvalidArgumentError(
                    f"{field}: unknown requirement {item!r}{hint}; valid: {valid}"
                ) from None
        return cls(**names)


#: the requirements of a layer that needs nothing special (frozen: one instance serves all)
_NO_REQUIREMENTS: Final = Requirements()


def _requirements(value: Any) -> Requirements:
    return Requirements.of(value)


def _layout(_: Any, __: Any, value: Any) -> None:
    if value is not None and not isinstance(value, SequenceLayout):
        raise InvalidArgumentError(
            f"layout: expected an attnres.SequenceLayout or None, got {value!r}"
        )


@frozen(cache_hash=True)
class LayerSpec:
    """One attention call site, as the resolver sees it."""

    head_size: int = field(converter=_positive_head_size)
    dtype: str = field(converter=normalize_dtype)
    supported: frozenset[Backend] | None = field(default=None, converter=_backend_set)
    default: Backend | None = field(default=None, converter=_default_backend)
    role: Role = field(default=Role.SELF, converter=_role)
    requirements: Requirements = field(default=_NO_REQUIREMENTS, converter=_requirements)
    name: str | None = field(default=None, converter=_name)
    # issue 24: the sequence-parallel layout of the call site (attnres.layout);
    # written to a trace only when set, so every older trace keeps its bytes
    layout: SequenceLayout | None = field(
        default=None, validator=_layout, metadata={"omit_default": True}
    )
    #: The route that executes this layer when it runs exactly the backends of
    #: ``supported`` (an integration's own code path or the transformers
    #: attention interface): a backend that only stands in for them
    #: (``BackendSpec.satisfies``) fails the machine's ``supported`` check
    #: (code ``not_on_route``), and messages name the route. ``None``: an
    #: attnres kernel call, which runs a stand-in's own kernel. Written to a
    #: trace only when set, so older traces keep their bytes.
    exact_route: str | None = field(
        default=None,
        converter=_exact_route,
        validator=_route_needs_supported,
        kw_only=True,
        metadata={"omit_default": True},
    )
    # issue 23 (both written to a trace only when set, so older traces keep their bytes):
    #: the backends automatic choices may take (the platform's chain, the supported
    #: set); ``supported`` stays what the layer's code can run. An explicit request
    #: outside ``preferred`` but inside ``supported`` is admitted when it passes
    #: every check, and the origin record says so. ``None``: all of ``supported``.
    preferred: frozenset[Backend] | None = field(
        default=None,
        converter=_preferred_set,
        kw_only=True,
        metadata={"omit_default": True},
    )
    #: the backend this layer must run for correctness: every request, schedule,
    #: global flag and autotune leaves it alone (origin ``layer``, strict), and the
    #: trace says what it overrode
    required: Backend | None = field(
        default=None,
        converter=_required_backend,
        kw_only=True,
        metadata={"omit_default": True},
    )
    #: issue 23: typed options of the kernels this layer may run, per backend
    #: (``BackendSpec.options``), checked when given: ``((backend, ((option,
    #: value), ...)), ...)``. They do not change the decision; the adapter gets
    #: the served backend's options at bind time. Written only when set.
    backend_options: BackendOptions = field(
        default=(), converter=normalize_backend_options, kw_only=True,
        metadata={"omit_default": True},
    )  # fmt: skip

    def __attrs_post_init__(self) -> None:
        supported = self.supported
        if (
            supported is not None
            and self.preferred is not None
            and not (self.preferred <= supported)
        ):
            extra = sorted(b.name for b in self.preferred - supported)
            raise InvalidArgumentError(
                f"preferred: {', '.join(extra)} not in the supported set "
                f"{sorted(b.name for b in supported)} (preferred narrows supported)"
            )
        if supported is not None and self.required is not None and self.required not in supported:
            raise InvalidArgumentError(
                f"required: {self.required.name!r} is not in the supported set "
                f"{sorted(b.name for b in supported)}"
            )


def split_component_key(key: str, *, strict: bool = False) -> tuple[str, Role | None]:
    """``"Text-Encoder"`` -> ``("text_encoder", None)``; ``"transformer.cross"`` ->
    ``("transformer", Role.CROSS)``.

    A key is a role override when the part after its last ``.`` is a role
    (``self`` or ``cross``); otherwise the whole key is a component name --
    unless ``strict`` (the command line), where any other part after a ``.`` is
    an error. Raises ``ValueError`` for an empty name.
    """
    name, dot, role_text = key.rpartition(".")
    role: Role | None = None
    if dot and role_text.strip().lower() in ("self", "cross") and normalize_component(name):
        role = Role.parse(role_text)
    elif dot and strict:
        raise InvalidArgumentError(
            f"{key!r}: the part after the last '.' must be a role, self or cross "
            f"(COMPONENT.ROLE=BACKEND overrides one role of a component)"
        )
    else:
        name = key
    component = normalize_component(name)
    if not component:
        raise InvalidArgumentError(f"component name must be a non-empty string, got {key!r}")
    return component, role


def _pairs(value: Any, what: str, expected: str) -> Iterator[tuple[Any, Any]]:
    """The (key, value) pairs of a mapping or of an iterable of pairs (a
    ``ValueError`` naming ``what`` and the ``expected`` pairs for anything else)."""
    for pair in value.items() if isinstance(value, Mapping) else value:
        try:
            key, item = pair
        except (TypeError, ValueError):
            raise InvalidArgumentError(f"{what}: expected {expected}, got {pair!r}") from None
        yield key, item


def _component_key(name: Any, what: str, star: str = "") -> str:
    """``COMPONENT`` or ``COMPONENT.ROLE`` normalised (``star``: how the message names
    the every-component key a field also takes)."""
    if not isinstance(name, str) or not name.strip():
        raise InvalidArgumentError(
            f"{what}: component name must be a non-empty string{star}, got {name!r}"
        )
    try:
        component, role = split_component_key(name)
    except ValueError as exc:
        raise InvalidArgumentError(f"{what}: {exc}") from None
    return component if role is None else f"{component}.{role.value}"


def _component_backends(value: Any) -> tuple[tuple[str, Backend], ...]:
    out: dict[str, Backend] = {}
    for name, backend in _pairs(value or (), "component_backends", "(component, backend) pairs"):
        key = _component_key(name, "component_backends")
        out[key] = _parse_backend(backend, f"component_backends[{name!r}]")
    return tuple(sorted(out.items()))


def _env_name(value: Any) -> str | None:
    if value is not None and (not isinstance(value, str) or not value):
        raise InvalidArgumentError(
            f"global_backend_env: expected a variable name or None, got {value!r}"
        )
    return value


def _non_negative_int(_: Any, attribute: Any, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidArgumentError(f"{attribute.name}: expected an integer >= 0, got {value!r}")


def _positive_int(_: Any, attribute: Any, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgumentError(f"{attribute.name}: expected an integer >= 1, got {value!r}")


def _check_fraction(what: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgumentError(f"{what}: expected a number in [0, 1), got {value!r}")
    number = float(value)
    if not 0 <= number < 1:
        raise InvalidArgumentError(
            f"{what}: expected a fraction in [0, 1) (0.02 means 2%), got {value!r}"
        )
    return number


def _margin(value: Any) -> float:
    return _check_fraction("autotune_margin", value)


def _tolerances(value: Any) -> tuple[tuple[str, float], ...]:
    """``{"bf16": 0.05}`` (dtype -> relative tolerance) as sorted canonical pairs."""
    out: dict[str, float] = {}
    expected = "a mapping of dtype to a relative tolerance ({'bf16': 0.05})"
    for dtype, tolerance in _pairs(value or (), "autotune_tolerance", expected):
        try:
            name = normalize_dtype(dtype)
        except ValueError as exc:
            raise InvalidArgumentError(f"autotune_tolerance: {exc}") from None
        out[name] = _check_fraction(f"autotune_tolerance[{name!r}]", tolerance)
    return tuple(sorted(out.items()))


# =============================================================================
# Issue 34: the attention error budget, per component or role
# =============================================================================

#: The budget that admits no lossy kernel (``--attention-error vae=exact``).
EXACT = "exact"
#: The key of the budget for every component (``--attention-error 2e-2``).
EVERY_COMPONENT = "*"

#: A budget: ``"exact"`` (no lossy kernel) or the largest relative L2 error
#: (``||out - ref|| / ||ref||`` against a float64 reference) a lossy kernel may have.
ErrorBudget = str | float


def parse_error_budget(value: object, what: str = "attention_error") -> ErrorBudget:
    """``"exact"`` or a relative L2 tolerance in (0, 1] (``"2e-2"``, ``0.02``)."""
    if isinstance(value, str) and value.strip().lower() == EXACT:
        return EXACT
    if isinstance(value, bool):
        raise InvalidArgumentError(
            f"{what}: expected 'exact' or a relative L2 error in (0, 1], got {value!r}"
        )
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise InvalidArgumentError(
            f"{what}: expected 'exact' or a relative L2 error in (0, 1], got {value!r}"
        ) from None
    if not (0.0 < number <= 1.0):  # NaN fails too
        raise InvalidArgumentError(
            f"{what}: a relative L2 error must be in (0, 1] (use 'exact' for none), got {value!r}"
        )
    return number


def describe_budget(budget: ErrorBudget) -> str:
    """``exact`` or ``rel L2 <= 0.02``."""
    return EXACT if budget == EXACT else f"rel L2 <= {budget:g}"


def _error_budgets(value: Any) -> tuple[tuple[str, ErrorBudget], ...]:
    """``{"vae": "exact", "transformer": 2e-2, "*": 0.05}`` as sorted canonical pairs:
    component names normalised as ``component_backends``'s (``COMPONENT.ROLE`` too),
    ``*`` for every component."""
    out: dict[str, ErrorBudget] = {}
    for name, budget in _pairs(value or (), "attention_error", "(component, budget) pairs"):
        key = (
            EVERY_COMPONENT
            if isinstance(name, str) and name.strip() == EVERY_COMPONENT
            else _component_key(name, "attention_error", " or '*'")
        )
        out[key] = parse_error_budget(budget, f"attention_error[{name!r}]")
    return tuple(sorted(out.items()))


def parse_attention_error(texts: Iterable[str]) -> dict[str, ErrorBudget]:
    """``--attention-error`` values (``vae=exact,transformer=2e-2`` or ``2e-2``,
    repeatable) as a mapping for ``SelectionConfig(attention_error=...)``.

    A bare budget is every component's (key ``*``); ``COMPONENT=BUDGET`` one
    component's, ``COMPONENT.ROLE=BUDGET`` one role of it. A key given twice with
    two budgets is an error.
    """
    out: dict[str, ErrorBudget] = {}
    for text in texts:
        for item in (p.strip() for p in str(text).split(",")):
            if not item:
                continue
            name, sep, raw = item.rpartition("=")
            key = EVERY_COMPONENT
            if sep:
                if not name.strip():
                    raise InvalidArgumentError(
                        f"--attention-error {item}: expected COMPONENT=BUDGET or BUDGET"
                    )
                component, role = split_component_key(name, strict=True)
                key = component if role is None else f"{component}.{role.value}"
            budget = parse_error_budget(raw, f"--attention-error {item}")
            if out.get(key, budget) != budget:
                raise InvalidArgumentError(
                    f"--attention-error: {key!r} was given two budgets ({out[key]} and "
                    f"{budget}); give it once"
                )
            out[key] = budget
    return out


#: The selection profiles (issue 23): the machine's rules for each.
PROFILES: tuple[str, ...] = ("attnres", "sglang", "vllm_omni")


def _profile(_: Any, __: Any, value: Any) -> None:
    if value not in PROFILES:
        raise InvalidArgumentError(f"profile: expected one of {', '.join(PROFILES)}, got {value!r}")


@frozen(cache_hash=True)
class SelectionConfig:
    """What the operator asked for, process-wide.

    ``global_backend_explicit`` tells an operator's typed ``--attention-backend``
    (origin ``global_cli``) from a derived or defaulted preference (origin
    ``global_preference``). ``global_backend_env`` names the environment
    variable that set the global backend (origin ``global_env``; relaxed and
    strict exactly like the flag). ``component_backends`` is the per-component
    form of the flag (``--attention-backend vae=torch_sdpa``): it acts as that
    component's override; a key ``component.role`` (``transformer.cross``) is a
    role override of that component. Component names are normalised
    (``Text-Encoder`` -> ``text_encoder``).
    """

    global_backend: Backend | None = field(default=None, converter=_global_backend)
    global_backend_explicit: bool = field(default=True, validator=_is_bool)
    forced_backend: Backend | None = field(default=None, converter=_forced_backend)
    #: issue 23: whose selection rules the machine applies -- ``attnres`` (the
    #: contract of docs/selection-contract.md) or ``sglang`` (SGLang
    #: multimodal_gen's, rows in attnres._profile_sglang). Written to a trace
    #: only when not the default, so older traces keep their bytes.
    profile: str = field(
        default="attnres", validator=_profile, kw_only=True, metadata={"omit_default": True}
    )
    component_backends: tuple[tuple[str, Backend], ...] = field(
        default=(), converter=_component_backends
    )
    #: where an explicit global backend came from when the environment set it
    #: (``ATTNRES_ATTENTION_BACKEND``; origin ``global_env``)
    global_backend_env: str | None = field(
        default=None, converter=_env_name, metadata={"omit_default": True}
    )
    # The autotune settings are not an input of the machine: a trace's config
    # leaves them out (a tuned trace records them in its tuning record), so
    # they are marked ``trace=False`` for the codec's field lists.
    #: measure automatic decisions on their first large forward (docs/selection-contract.md)
    #: issue 23: per-backend kernel options for every layer built under this
    #: config (``{"fa": {"deterministic": True}}``); a layer's own
    #: ``backend_options`` win option by option. Each layer records the merged
    #: options in its trace input (LayerSpec.backend_options), so the config
    #: does not write them.
    backend_options: BackendOptions = field(
        default=(), converter=normalize_backend_options, kw_only=True, metadata=_NOT_IN_TRACE
    )
    autotune: bool = field(default=False, validator=_is_bool, metadata=_NOT_IN_TRACE)
    #: issue 34: the attention error budget per component, role or every
    #: component (``*``): ``"exact"`` or a relative L2 error (see
    #: :func:`parse_attention_error`). A lossy candidate is checked against the
    #: budget of its layer (the ``precision`` check); no budget: no check, as
    #: before. Written to a trace only when set (schema version 6).
    attention_error: tuple[tuple[str, ErrorBudget], ...] = field(
        default=(), converter=_error_budgets, kw_only=True, metadata={"omit_default": True}
    )
    #: a forward whose query holds fewer elements stays on the incumbent (the
    #: tuner stays armed); SGLang's multimodal tuner waits for 4 Mi elements too
    autotune_min_elements: int = field(
        default=4 << 20, validator=_non_negative_int, metadata=_NOT_IN_TRACE
    )
    #: a candidate must be faster than the incumbent by more than this fraction
    autotune_margin: float = field(default=0.02, converter=_margin, metadata=_NOT_IN_TRACE)
    #: per-dtype relative tolerance overrides ({"bf16": 0.05}); see attnres.tuning
    autotune_tolerance: tuple[tuple[str, float], ...] = field(
        default=(), converter=_tolerances, metadata=_NOT_IN_TRACE
    )
    #: untimed calls before the timed ones, and the timed calls, per candidate
    autotune_warmup: int = field(default=3, validator=_non_negative_int, metadata=_NOT_IN_TRACE)
    autotune_repeats: int = field(default=8, validator=_positive_int, metadata=_NOT_IN_TRACE)

    def __attrs_post_init__(self) -> None:
        if self.global_backend_env is not None and (
            self.global_backend is None or not self.global_backend_explicit
        ):
            raise InvalidArgumentError(
                f"global_backend_env: {self.global_backend_env} names where an explicit global "
                f"backend came from; it needs global_backend set and global_backend_explicit=True"
            )

    def component_backend(self, component: str | None) -> Backend | None:
        if component is None:
            return None
        key = normalize_component(component)
        for name, backend in self.component_backends:
            if name == key:
                return backend
        return None

    def role_backend(self, component: str | None, role: Role) -> Backend | None:
        """The ``component.role`` override (``--attention-backend transformer.cross=X``)."""
        if component is None or not self.component_backends:
            return None
        key = f"{normalize_component(component)}.{role.value}"
        for name, backend in self.component_backends:
            if name == key:
                return backend
        return None

    def error_budget(
        self, component: str | None, kind: str | None, role: Role
    ) -> tuple[str, ErrorBudget] | None:
        """Issue 34: the budget a layer is held to and the key that set it: the
        first of ``COMPONENT.ROLE``, ``COMPONENT``, ``KIND.ROLE``, ``KIND``, ``*``
        in ``attention_error`` (``text_encoder`` holds ``text_encoder_2``, whose
        kind it is); ``None``: no budget (no precision check)."""
        if not self.attention_error:
            return None
        keys: list[str] = []
        for name in (component, kind):
            if name:
                key = normalize_component(name)
                keys += [f"{key}.{role.value}", key]
        keys.append(EVERY_COMPONENT)
        table = dict(self.attention_error)
        for key in keys:
            if key in table:
                return key, table[key]
        return None

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, *, base: SelectionConfig | None = None
    ) -> SelectionConfig:
        """``base`` (default: an empty config) with ``ATTNRES_ATTENTION_BACKEND`` applied.

        The variable sets the global backend, as an explicit operator choice
        (origin ``global_env``), only where ``base`` has no explicit global
        backend: the typed flag beats it. Unset or blank: ``base`` unchanged.
        A bad value is a ``ValueError`` naming the variable.
        """
        env = os.environ if environ is None else environ
        config = cls() if base is None else base
        text = env.get(ENV_VAR, "").strip()
        if not text or (config.global_backend is not None and config.global_backend_explicit):
            return config
        if "=" in text or "," in text:
            raise InvalidArgumentError(
                f"{ENV_VAR}={text!r}: the variable sets the global backend only (one backend "
                f"name); use --attention-backend COMPONENT=BACKEND for one component"
            )
        try:
            backend = Backend.parse(text)
        except UnknownBackendError as exc:
            raise UnknownBackendError(f"{ENV_VAR}: {exc}", exc.name, exc.suggestion) from None
        return attrs.evolve(
            config, global_backend=backend, global_backend_explicit=True, global_backend_env=ENV_VAR
        )

    @classmethod
    def from_args(cls, namespace: Any) -> SelectionConfig:
        """Build from an argparse namespace filled by ``cli.add_selection_arguments``.

        ``global_backend_explicit`` is true only when the operator typed the flag;
        a program default left in place is a preference (false). Without a typed
        flag, ``ATTNRES_ATTENTION_BACKEND`` sets the global backend (origin
        ``global_env``): the flag beats the variable, the variable beats a
        program default.
        """
        global_backend = getattr(namespace, DEST_BACKEND, None)
        explicit = bool(getattr(namespace, DEST_EXPLICIT, False))
        components = getattr(namespace, DEST_COMPONENTS, None) or {}
        autotune = bool(getattr(namespace, DEST_AUTOTUNE, False))
        min_elements = getattr(namespace, DEST_AUTOTUNE_MIN, None)
        tuning: dict[str, Any] = {"autotune": autotune}
        if min_elements is not None:
            if not autotune:
                raise InvalidArgumentError("--autotune-min-elements needs --autotune")
            tuning["autotune_min_elements"] = min_elements
        config = cls(
            global_backend=global_backend,
            global_backend_explicit=explicit if global_backend is not None else True,
            component_backends=dict(components),
            attention_error=parse_attention_error(
                getattr(namespace, DEST_ATTENTION_ERROR, None) or ()
            ),
            **tuning,
        )
        return config if explicit else cls.from_env(base=config)
