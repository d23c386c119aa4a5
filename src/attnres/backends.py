"""The backend catalogue: names, declarative capability specs, the registry.

A backend's facts are data (a frozen :class:`BackendSpec`), kept in one
catalogue (``BUILTIN_SPECS`` below) with the source of every fact in
``docs/backends.md``. The checks that read these facts live in
:mod:`attnres.machine`; this module only states them.

Third-party backends arrive through :func:`register_backend` or the entry-point
group ``attnres.backends`` (a ``BackendSpec``, an iterable of them, or a
callable returning either). A plugin that fails to load is recorded, never
raised; two plugins claiming one name is a :class:`PluginError`.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import re
import threading
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Generic, TypeVar

import attrs
from attrs import field, frozen

from attnres._vocab import (
    DTYPES,
    PLATFORM_KINDS,
    REQUIREMENT_PHRASES,
    MaskKind,
    MaskRoute,
    Requirement,
    release,
)
from attnres.errors import (
    ArgumentTypeError,
    BackendOptionError,
    InvalidArgumentError,
    PluginError,
    UnknownBackendError,
)

__all__ = [
    "BUILTIN_SPECS",
    "ENTRY_POINT_GROUP",
    "LSE_SOURCES",
    "PRECISION_FACTS",
    "Backend",
    "BackendOption",
    "BackendSpec",
    "CapabilityRule",
    "EntryPoint",
    "FrozenMap",
    "HeadSizeRule",
    "KernelFacts",
    "MaskSupport",
    "OptionLimit",
    "PluginFailure",
    "Precision",
    "RequirementLimit",
    "entry_point_options",
    "get_spec",
    "installed_facts",
    "merge_backend_options",
    "normalize_backend_options",
    "parse_backend_option",
    "plugin_failures",
    "precision_of",
    "register_backend",
    "registered_backends",
    "unregister_backend",
]

ENTRY_POINT_GROUP = "attnres.backends"


@frozen(eq=False, order=False)
class Backend:
    """A registered attention backend, by its canonical lower-case name.

    ``Backend.parse("SAGE_ATTN")`` and ``Backend.parse("sdpa")`` accept any case
    and the registered aliases; an unknown name raises
    :class:`~attnres.errors.UnknownBackendError` listing the valid names.

    The one type of a backend on every record (``Resolution``, ``Decision``,
    ``LayerPlan``, the trace's ``Outcome``). Like a ``StrEnum`` member it equals
    (and hashes like) its canonical name, so ``decision.backend == "fa"`` reads
    as it should; documents write the name (a JSON string).
    """

    name: str

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Backend):
            return self.name == other.name
        if isinstance(other, str):
            return self.name == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.name)

    def __format__(self, spec: str) -> str:
        return format(self.name, spec)

    @classmethod
    def parse(cls, value: Backend | str) -> Backend:
        if isinstance(value, Backend):
            return value
        if not isinstance(value, str):
            raise ArgumentTypeError(
                f"backend must be a Backend or a str, got {type(value).__name__}"
            )
        return _REGISTRY.lookup(value)

    @property
    def spec(self) -> BackendSpec:
        return get_spec(self)

    @property
    def is_sparse(self) -> bool:
        return self.spec.sparse

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"Backend({self.name!r})"


def _to_frozenset_str(value: Iterable[Any] | None) -> frozenset[str] | None:
    return None if value is None else frozenset(str(v) for v in value)


def _int_set(value: Iterable[int] | None) -> frozenset[int] | None:
    return None if value is None else frozenset(int(v) for v in value)


def _capability_set(
    value: Iterable[tuple[int, int]] | None,
) -> frozenset[tuple[int, int]] | None:
    return None if value is None else frozenset((int(a), int(b)) for a, b in value)


def _groups(value: Iterable[Iterable[str]]) -> tuple[frozenset[str], ...]:
    return tuple(frozenset(g) for g in value)


_K = TypeVar("_K")
_V = TypeVar("_V")


class FrozenMap(Mapping[_K, _V], Generic[_K, _V]):
    """A read-only, hashable mapping (the per-kind tables of a :class:`BackendSpec`).

    Built from a dict or pairs; it cannot be changed after construction, so a
    spec in the registry stays what it was registered as.
    """

    __slots__ = ("_data", "_hash")

    def __init__(self, items: Mapping[_K, _V] | Iterable[tuple[_K, _V]] = ()) -> None:
        self._data: dict[_K, _V] = dict(items)
        self._hash: int | None = None

    def __getitem__(self, key: _K) -> _V:
        return self._data[key]

    def get(self, key: _K, default: Any = None) -> Any:
        # the dict's own get (Mapping.get goes through __getitem__ and KeyError):
        # the machine's platform check reads these tables on every cold resolution
        return self._data.get(key, default)

    def __iter__(self) -> Iterator[_K]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(frozenset(self._data.items()))
        return self._hash

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Mapping):
            return self._data == dict(other)
        return NotImplemented

    def __repr__(self) -> str:
        return f"FrozenMap({self._data!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (FrozenMap, (self._data,))


def _capability_map(value: Mapping[str, CapabilityRule]) -> FrozenMap[str, CapabilityRule]:
    return value if isinstance(value, FrozenMap) else FrozenMap(value)


def _min_torch_map(value: Mapping[str, tuple[int, int]]) -> FrozenMap[str, tuple[int, int]]:
    return FrozenMap({str(k): (int(v[0]), int(v[1])) for k, v in dict(value).items()})


def _kernel_path(value: str | None) -> str | None:
    if value is None:
        return None
    module, sep, factory = str(value).partition(":")
    if not (module and sep and factory):
        raise InvalidArgumentError(
            f"kernel: expected 'package.module:factory' or None, got {value!r}"
        )
    return str(value)


@frozen
class HeadSizeRule:
    """Which head sizes a kernel takes: bounds, a multiple, or an explicit set."""

    min: int = 1
    max: int | None = None
    multiple_of: int | None = None
    allowed: frozenset[int] | None = field(default=None, converter=_int_set)
    power_of_two: bool = False

    def failures(self, head_size: int) -> list[str]:
        """Every way ``head_size`` misses this rule (empty when it fits)."""
        out: list[str] = []
        if self.allowed is not None and head_size not in self.allowed:
            out.append(f"head size {head_size} is not one of {sorted(self.allowed)}")
        if head_size < self.min:
            out.append(f"head size {head_size} is below the minimum {self.min}")
        if self.max is not None and head_size > self.max:
            out.append(f"head size {head_size} exceeds the maximum {self.max}")
        if self.multiple_of is not None and head_size % self.multiple_of:
            out.append(f"head size {head_size} is not a multiple of {self.multiple_of}")
        if self.power_of_two and head_size & (head_size - 1):
            out.append(f"head size {head_size} is not a power of two")
        return out

    def describe(self) -> str:
        if self.allowed is not None:
            return "{" + ", ".join(str(s) for s in sorted(self.allowed)) + "}"
        parts: list[str] = []
        if self.max is not None:
            parts.append(f"<= {self.max}")
        if self.min > 1:
            parts.append(f">= {self.min}")
        if self.multiple_of is not None:
            parts.append(f"multiple of {self.multiple_of}")
        if self.power_of_two:
            parts.append("power of two")
        return ", ".join(parts) or "any"


@frozen
class CapabilityRule:
    """Which devices of a kind a kernel runs on.

    For CUDA: an inclusive compute-capability range and/or an explicit set of
    capabilities. For ROCm (and other kinds with named architectures): a set of
    architecture names such as ``gfx942``.
    """

    min: tuple[int, int] | None = None
    max: tuple[int, int] | None = None
    exact: frozenset[tuple[int, int]] | None = field(default=None, converter=_capability_set)
    archs: frozenset[str] | None = field(default=None, converter=_to_frozenset_str)

    @property
    def restricts_capability(self) -> bool:
        """Whether the rule says anything about a CUDA compute capability."""
        return self.min is not None or self.max is not None or self.exact is not None

    def fits(self, capability: tuple[int, int]) -> bool:
        """Whether a device of this compute capability is one the rule admits.

        A range (``min``/``max``) and an ``exact`` set together admit either; an
        ``exact`` set alone admits only its members.
        """
        in_range = (self.min is None or capability >= self.min) and (
            self.max is None or capability <= self.max
        )
        if self.exact is None:
            return in_range
        if self.min is None and self.max is None:
            return capability in self.exact
        return in_range or capability in self.exact

    def describe(self) -> str:
        parts: list[str] = []
        if self.exact is not None:
            parts.append("sm" + "/".join(f"{a}{b}" for a, b in sorted(self.exact)))
        if self.min is not None or self.max is not None:
            lo = f"sm{self.min[0]}{self.min[1]}" if self.min else ""
            hi = f"sm{self.max[0]}{self.max[1]}" if self.max else ""
            parts.append(f"{lo}-{hi}" if lo and hi else f"<= {hi}" if hi else f">= {lo}")
        if self.archs is not None:
            parts.append("/".join(sorted(self.archs)))
        return ", ".join(parts) or "any"


#: A canonical backend name: ASCII lower-case letters, digits and '_'.
_NAME_RE = re.compile(r"[a-z0-9_]*[a-z0-9][a-z0-9_]*")


def _key(text: str) -> str:
    """How a name or alias is matched: case-insensitive, '-' is '_'."""
    return text.strip().lower().replace("-", "_")


def _requirements(value: Iterable[Requirement | str]) -> frozenset[Requirement]:
    return frozenset(Requirement(v) for v in value)


def _platforms(value: Iterable[str]) -> frozenset[str]:
    kinds = frozenset(value)
    unknown = kinds - set(PLATFORM_KINDS)
    if unknown:
        raise InvalidArgumentError(f"platforms: unknown platform kinds {sorted(unknown)}")
    return kinds


def _dtypes(value: Iterable[str]) -> frozenset[str]:
    names = frozenset(value)
    unknown = names - set(DTYPES)
    if unknown:
        raise InvalidArgumentError(f"dtypes: unknown dtype names {sorted(unknown)}")
    return names


def _str_tuple(value: Iterable[str]) -> tuple[str, ...]:
    return tuple(str(v) for v in value)


def _optional_platforms(value: Iterable[str] | None) -> frozenset[str] | None:
    return None if value is None else _platforms(value)


_R = TypeVar("_R")


def _records(value: Iterable[_R], kind: type[_R], label: str) -> tuple[_R, ...]:
    """``value`` as a tuple of ``kind`` records (the converter of a spec's record
    fields): anything else in it is a ``TypeError`` naming the field."""
    out = tuple(value)
    for item in out:
        if not isinstance(item, kind):
            raise ArgumentTypeError(f"{label}: expected {kind.__name__} records, got {item!r}")
    return out


def _limits(value: Iterable[RequirementLimit]) -> tuple[RequirementLimit, ...]:
    return _records(value, RequirementLimit, "limits")


def _dtype_capabilities(
    value: Mapping[str, CapabilityRule],
) -> FrozenMap[str, CapabilityRule]:
    _dtypes(value)
    return FrozenMap(value)


#: A value a backend option may take (plain data: it goes into traces and cache keys).
#: (issue 36: ``float`` for vLLM-Omni's typed AttentionSpec options, such as a sparsity)
OptionValue = bool | int | float | str | None

#: Validated per-backend options: ``((backend, ((option, value), ...)), ...)``, sorted.
BackendOptions = tuple[tuple[str, tuple[tuple[str, OptionValue], ...]], ...]

_OPTION_KINDS: dict[str, tuple[type, ...]] = {"bool": (bool,), "int": (int,), "str": (str,)}
#: issue 36: a float option takes an int too (JSON and TOML write ``1`` for ``1.0``)
_OPTION_KINDS["float"] = (float, int)


@frozen
class BackendOption:
    """One typed keyword argument of a backend's kernel that a user may set (issue 23).

    ``kind`` is ``"bool"``, ``"int"`` or ``"str"``; ``choices`` (empty: any
    value of the kind) and ``minimum`` (ints) bound it; ``nullable`` admits
    ``None``; ``default`` is the kernel's own default; ``source`` cites the
    kernel signature it was read from (docs/backends.md).
    """

    name: str
    kind: str = field(validator=attrs.validators.in_(tuple(_OPTION_KINDS)))
    default: OptionValue
    source: str
    choices: tuple[OptionValue, ...] = ()
    minimum: int | float | None = None
    nullable: bool = False
    #: issue 36: an upper bound (ints and floats), as vLLM-Omni's ranges state one
    maximum: int | float | None = None

    def takes(self, value: object) -> bool:
        """Whether this option takes ``value`` (the one value check: :meth:`check`,
        and :func:`entry_point_options` for a function's narrower option)."""
        return (value is None and self.nullable) or (
            isinstance(value, _OPTION_KINDS[self.kind])
            and (self.kind == "bool" or not isinstance(value, bool))
            and (not self.choices or value in self.choices)
            and (self.minimum is None or value >= self.minimum)  # type: ignore[operator]
            and (self.maximum is None or value <= self.maximum)  # type: ignore[operator]
        )

    def check(self, backend: str, value: object) -> OptionValue:
        """``value`` if this option takes it, else a :class:`BackendOptionError`."""
        if not self.takes(value):
            raise BackendOptionError(
                f"backend_options: {backend}.{self.name}={value!r} is not allowed; "
                f"expected {self.describe()} (from {self.source})",
                backend,
                self.name,
            )
        return value  # type: ignore[return-value]

    def describe(self) -> str:
        """What the option takes, in words (errors and ``attnres backends``)."""
        if self.choices:
            text = "one of " + ", ".join(repr(c) for c in self.choices)
        elif self.minimum is not None or self.maximum is not None:
            bounds = [f">= {self.minimum}"] if self.minimum is not None else []
            bounds += [f"<= {self.maximum}"] if self.maximum is not None else []
            text = f"{'an' if self.kind == 'int' else 'a'} {self.kind} {' and '.join(bounds)}"
        else:
            text = "a " + self.kind
        return text + (" or None" if self.nullable else "")


def _options(value: Iterable[BackendOption]) -> tuple[BackendOption, ...]:
    return _records(value, BackendOption, "options")


def _capabilities(value: Iterable[tuple[int, int]]) -> frozenset[tuple[int, int]]:
    return frozenset((int(major), int(minor)) for major, minor in value)


@frozen
class EntryPoint:
    """One function of a kernel package that its dispatcher picks per GPU (issue 23).

    SageAttention's ``sageattn`` runs one function per compute capability and
    passes it fixed settings, never the caller's (thu-ml/SageAttention
    ``sageattention/core.py``). A layer given options calls that function
    itself: ``name`` on the devices ``capabilities`` lists (exact (major,
    minor), as the dispatcher compares them), with the dispatcher's own settings
    (``passes``) under the user's options. ``options`` are the keyword arguments
    the function takes that a user may set, each with the values it takes there
    (a subset of the spec's declared option of that name). ``varlen``: the
    varlen entry point (``BackendSpec.varlen_kernel``), on every device.
    """

    name: str
    source: str
    options: tuple[BackendOption, ...] = field(default=(), converter=_options)
    capabilities: frozenset[tuple[int, int]] = field(default=(), converter=_capabilities)
    passes: tuple[tuple[str, OptionValue], ...] = ()
    varlen: bool = False

    def option(self, name: str) -> BackendOption | None:
        """The option ``name`` as this function takes it (``None``: it does not)."""
        return next((o for o in self.options if o.name == name), None)

    def serves(self, capability: tuple[int, int] | None, varlen: bool) -> bool:
        return self.varlen == varlen and (varlen or capability in self.capabilities)


def _entry_points(value: Iterable[EntryPoint]) -> tuple[EntryPoint, ...]:
    return _records(value, EntryPoint, "entry_points")


def _sm(capability: tuple[int, int] | None) -> str:
    return "an unknown GPU" if capability is None else f"sm{capability[0]}{capability[1]}"


def _together(requirements: frozenset[Requirement]) -> str:
    """The newest requirement leads: "the backward pass together with grouped-query attention"."""
    ordered = [r for r in reversed(Requirement) if r in requirements]
    return " together with ".join(REQUIREMENT_PHRASES[r] for r in ordered)


@frozen
class RequirementLimit:
    """Where a kernel does not implement requirements its spec claims.

    ``BackendSpec.implements`` claims each requirement on its own; a limit
    withdraws the claim for a layer that needs every requirement in
    ``requirements`` at once (``{backward, gqa}``: no GQA in the backward pass),
    on the device kinds in ``platforms`` (``None``: every kind) and the CUDA
    devices ``capabilities`` admits (``None``: every device). ``because`` says
    why, as the kernel's source does; it is shown in the failure.
    """

    requirements: frozenset[Requirement] = field(converter=_requirements)
    because: str
    platforms: frozenset[str] | None = field(default=None, converter=_optional_platforms)
    capabilities: CapabilityRule | None = None

    def __attrs_post_init__(self) -> None:
        if not self.requirements:
            raise InvalidArgumentError("a RequirementLimit names at least one requirement")

    def applies(
        self, needed: Iterable[Requirement], kind: str, capability: tuple[int, int] | None
    ) -> bool:
        """Whether the limit withdraws the claim for this layer on this platform.

        An unknown capability counts as admitted by ``capabilities`` (fail
        closed: the limit applies).
        """
        if not self.requirements <= frozenset(needed):
            return False
        if self.platforms is not None and kind not in self.platforms:
            return False
        if self.capabilities is not None and capability is not None:
            return self.capabilities.fits(capability)
        return True

    def describe(self) -> str:
        """``"the backward pass together with grouped-query attention on cpu"``."""
        text = _together(self.requirements)
        if self.platforms is not None:
            text += " on " + "/".join(k for k in PLATFORM_KINDS if k in self.platforms)
        if self.capabilities is not None:
            text += " on " + self.capabilities.describe()
        return text


def _mask_kind(value: MaskKind | str) -> MaskKind:
    kind = MaskKind(value)
    if kind in (MaskKind.NONE, MaskKind.ANY):
        raise InvalidArgumentError(
            f"MaskSupport: kind must be key_padding, boolean or additive, got {kind.value!r} "
            f"('any' is boolean and additive together)"
        )
    return kind


@frozen
class MaskSupport:
    """How a kernel takes one kind of mask (issue 22), and the source of the fact.

    ``route`` is ``native`` (the kernel takes the mask, or its equivalent, as an
    argument) or ``unpad`` (key padding only: attnres unpads the batch, runs the
    spec's ``varlen_kernel`` on the packed tokens and pads the output back;
    padded query rows are zeros where the mask marks them, docs/masks.md). ``source`` says where
    the fact was read (file and function of the kernel's own code or docs).
    """

    kind: MaskKind = field(converter=_mask_kind)
    route: MaskRoute = field(converter=MaskRoute)
    source: str = ""

    def __attrs_post_init__(self) -> None:
        if self.route is MaskRoute.UNPAD and self.kind is not MaskKind.KEY_PADDING:
            raise InvalidArgumentError(
                f"MaskSupport: only key padding can be taken by unpadding, not {self.kind.value}"
            )


def _masks(value: Iterable[MaskSupport]) -> tuple[MaskSupport, ...]:
    out = _records(value, MaskSupport, "masks")
    kinds = [m.kind for m in out]
    if len(set(kinds)) != len(kinds):
        raise InvalidArgumentError("masks: one MaskSupport per mask kind")
    return out


@frozen
class OptionLimit:
    """Where a kernel refuses one value of one of its options (issue 31).

    ``option=value`` fails in the kernel for a layer that needs every
    requirement in ``requirements`` (``{backward}``: the backward pass refuses
    it), on the CUDA devices ``capabilities`` admits (``None``: every device),
    at the head sizes ``head_sizes`` admits (``None``: every head size). Checked
    with the layer's options (``attnres._varlen.check_layer_options``): options
    never change the decision, a refused one is a
    :class:`~attnres.errors.BackendOptionError` when the layer is built, not at
    its first backward pass. ``because`` cites the kernel's own check.
    """

    option: str
    value: OptionValue
    because: str
    requirements: frozenset[Requirement] = field(default=(), converter=_requirements)
    capabilities: CapabilityRule | None = None
    head_sizes: HeadSizeRule | None = None

    def applies(
        self,
        options: Mapping[str, OptionValue],
        needed: Iterable[Requirement],
        capability: tuple[int, int] | None,
        head_size: int,
    ) -> bool:
        """Whether the limit refuses these options for this layer (an unknown
        capability counts as admitted: fail closed)."""
        if self.option not in options or options[self.option] != self.value:
            return False
        if not self.requirements <= frozenset(needed):
            return False
        if self.head_sizes is not None and self.head_sizes.failures(head_size):
            return False
        return not (
            self.capabilities is not None
            and capability is not None
            and not self.capabilities.fits(capability)
        )

    def describe(self) -> str:
        """``"deterministic=True in the backward pass on sm120-sm121"``."""
        text = f"{self.option}={self.value!r}"
        if self.requirements:
            text += " with " + _together(self.requirements)
        if self.capabilities is not None:
            text += " on " + self.capabilities.describe()
        if self.head_sizes is not None:
            text += f" at head sizes {self.head_sizes.describe()}"
        return text


def _option_limits(value: Iterable[OptionLimit]) -> tuple[OptionLimit, ...]:
    return _records(value, OptionLimit, "option_limits")


#: The :class:`BackendSpec` fields a :class:`KernelFacts` may replace.
_VARIANT_FIELDS = frozenset(
    {
        "dtypes",
        "head_sizes",
        "implements",
        "capabilities",
        "limits",
        "dtype_capabilities",
        "masks",
        "varlen_kernel",
        "options",
        "entry_points",
        "lse",
        "varlen_causal_unequal",
        "causal_top_left",
        "option_limits",
        "refuses",
    }
)


def _changes(value: Mapping[str, Any]) -> FrozenMap[str, Any]:
    unknown = set(value) - _VARIANT_FIELDS
    if unknown:
        raise InvalidArgumentError(
            f"KernelFacts.changes: {sorted(unknown)} cannot vary by version or GPU "
            f"(these can: {', '.join(sorted(_VARIANT_FIELDS))})"
        )
    return value if isinstance(value, FrozenMap) else FrozenMap(value)


@frozen
class KernelFacts:
    """Facts that replace a spec's own for one range of a distribution's
    versions and/or one range of GPUs (issue 31).

    A spec's own fields describe the kernel its ``release`` names (SageAttention
    2+ for ``sage_attn``). Where the installed distribution (the platform's
    :class:`~attnres.platform.PackageFact`: ``distribution`` and ``version``) is
    ``distribution`` at a version in ``[since, before)``, and the CUDA device is
    one ``capabilities`` admits, ``changes`` (spec field -> value) replace the
    spec's own: SageAttention 1 (``sageattention`` < 2) is another kernel under
    the same package name. ``distribution=None``: any installed version;
    ``capabilities=None``: any device. A capability-keyed entry applies only on
    a known capability. ``kernel`` names what the entry describes; ``source``
    cites where it was read.
    """

    kernel: str
    source: str
    changes: FrozenMap[str, Any] = field(factory=FrozenMap, converter=_changes)
    distribution: str | None = None
    since: str | None = None
    before: str | None = None
    capabilities: CapabilityRule | None = None

    def matches(
        self,
        distribution: str | None,
        version: str | None,
        kind: str,
        capability: tuple[int, int] | None,
    ) -> bool:
        """Whether this entry describes the installed kernel on this device."""
        if self.distribution is not None:
            if distribution is None or _key(distribution) != _key(self.distribution):
                return False
            found = release(version or "")
            if not found and (self.since or self.before):
                return False
            if self.since is not None and found < release(self.since):
                return False
            if self.before is not None and found >= release(self.before):
                return False
        if self.capabilities is not None:
            return kind == "cuda" and capability is not None and self.capabilities.fits(capability)
        return True

    def describe(self) -> str:
        """``"sageattention < 2"``, ``"on sm100-sm110"``: where the entry applies."""
        parts: list[str] = []
        if self.distribution is not None:
            bounds = [
                f">= {self.since}" if self.since else "",
                f"< {self.before}" if self.before else "",
            ]
            text = ", ".join(b for b in bounds if b) or "(any version)"
            parts.append(f"{self.distribution} {text}")
        if self.capabilities is not None:
            parts.append("on " + self.capabilities.describe())
        return " ".join(parts) or "always"


def _variants(value: Iterable[KernelFacts]) -> tuple[KernelFacts, ...]:
    return _records(value, KernelFacts, "variants")


@frozen
class Precision:
    """Issue 34: how exact one kernel's output is, for one range of versions and
    GPUs, and the source that says so.

    ``lossy`` is false for a kernel exact to its dtype (it computes in the
    inputs' dtype with at least fp32 softmax and accumulation: its error is the
    dtype's rounding, what any exact kernel has); true for one that quantises
    inside (SageAttention's int8 Q and K, fp8 P and V; SageAttention3's fp4).
    ``qk``, ``pv``, ``accumulator`` and ``inputs`` say how, in words; ``applies``
    says where (a :class:`KernelFacts` with no ``changes``: its distribution and
    version range, its GPUs, the kernel it describes and the ``source`` it was
    read from).
    """

    lossy: bool
    applies: KernelFacts
    qk: str = ""
    pv: str = ""
    accumulator: str = ""
    inputs: str = ""

    @property
    def kind(self) -> str:
        """``lossy`` or ``exact`` (to its dtype)."""
        return "lossy" if self.lossy else "exact"

    @property
    def source(self) -> str:
        return self.applies.source

    def describe(self) -> str:
        """``"lossy: Q, K int8 ...; P, V fp8 e4m3 ...; fp32 accumulate"`` (one line)."""
        parts = [p for p in (self.inputs, self.qk, self.pv, self.accumulator) if p]
        return f"{self.kind}: " + "; ".join(parts) if parts else self.kind


def _precisions(value: Iterable[Precision]) -> tuple[Precision, ...]:
    return _records(value, Precision, "precision")


def precision_of(
    spec: BackendSpec,
    distribution: str | None,
    version: str | None,
    kind: str,
    capability: tuple[int, int] | None,
) -> Precision | None:
    """The first of ``spec.precision`` that describes the installed kernel on this
    device (issue 34); ``None``: the spec declares none that applies here."""
    for fact in spec.precision:
        if fact.applies.matches(distribution, version, kind, capability):
            return fact
    return None


#: What a spec that claims ``attn_mask`` (0.2's one flag) takes when it says no more.
_LEGACY_MASK_SOURCE = "claims attn_mask: takes any boolean or additive mask tensor"


@frozen
class BackendSpec:
    """Everything the resolver may know about one backend, as plain data.

    - ``capabilities`` maps a platform kind to the devices of that kind the
      kernel runs on (a kind missing from the map has no restriction);
    - ``package`` is the optional kernel package whose presence it needs
      (``None``: built into torch);
    - ``satisfies``: groups of backend names; the backend counts as supported
      by a layer whose supported set contains every name of one group
      (``torch_cudnn_sdpa`` satisfies ``{torch_sdpa}``, ``dynamic_cudnn_sdpa``
      needs ``{fa, torch_sdpa}``);
    - ``min_torch``: per platform kind, the oldest torch that ships the kernel;
    - ``kernel``: the ``"package.module:factory"`` of the adapter that runs it
      (``None``: no adapter ships with the spec; a kernel may still be given to
      :func:`attnres.kernels.register_kernel`). Whether a kernel serves the
      backend in this process is :func:`attnres.kernels.kernel_source`;
    - ``sparse``: a sparse kernel (needs layout metadata; never serves
      cross-attention);
    - ``limits``: where the kernel does not implement requirements that
      ``implements`` claims (:class:`RequirementLimit`);
    - ``dtype_capabilities``: per dtype, the CUDA devices that take it when that
      is narrower than ``capabilities`` (xformers: bf16 only from sm80);
    - ``package_alternatives``: packages that serve in place of ``package``
      (another packaging of the same kernel); ``extra_packages``: packages
      needed as well as ``package``;
    - ``masks``: the mask kinds the kernel takes and how
      (:class:`MaskSupport`); a spec that implements ``attn_mask`` takes every
      kind natively unless an entry says otherwise; ``varlen_kernel``: the
      ``"package.module:factory"`` of its varlen adapter (packed tokens and
      ``cu_seqlens``), which the ``unpad`` route runs.

    The per-kind tables are :class:`FrozenMap` (read-only): a spec is data
    that cannot change once registered.
    """

    name: str = field()
    sparse: bool = field()
    platforms: frozenset[str] = field(converter=_platforms)
    dtypes: frozenset[str] = field(converter=_dtypes)
    head_sizes: HeadSizeRule = HeadSizeRule()
    implements: frozenset[Requirement] = field(default=(), converter=_requirements)
    package: str | None = None
    capabilities: FrozenMap[str, CapabilityRule] = field(
        factory=FrozenMap, converter=_capability_map
    )
    satisfies: tuple[frozenset[str], ...] = field(default=(), converter=_groups)
    aliases: tuple[str, ...] = ()
    min_torch: FrozenMap[str, tuple[int, int]] = field(factory=FrozenMap, converter=_min_torch_map)
    description: str = ""
    #: whether a causal mask keeps torch SDPA's top-left alignment when query and
    #: key lengths differ (cross-attention); flash-attn aligns it bottom-right
    causal_top_left: bool = True
    kernel: str | None = field(default=None, converter=_kernel_path)
    limits: tuple[RequirementLimit, ...] = field(default=(), converter=_limits)
    dtype_capabilities: FrozenMap[str, CapabilityRule] = field(
        factory=FrozenMap, converter=_dtype_capabilities
    )
    package_alternatives: tuple[str, ...] = field(default=(), converter=_str_tuple)
    extra_packages: tuple[str, ...] = field(default=(), converter=_str_tuple)
    masks: tuple[MaskSupport, ...] = field(default=(), converter=_masks)
    varlen_kernel: str | None = field(default=None, converter=_kernel_path)
    #: issue 23: typed keyword arguments of the kernel a user may set
    #: (``Attention(backend_options=...)``); the adapter passes them at bind time
    options: tuple[BackendOption, ...] = field(default=(), converter=_options)
    #: issue 23: the functions a dispatching kernel runs per GPU, where the
    #: dispatcher does not pass options on (SageAttention's ``sageattn``): a layer
    #: with options calls the device's own function (:func:`entry_point_options`)
    entry_points: tuple[EntryPoint, ...] = field(default=(), converter=_entry_points)

    #: issue 24: how the kernel returns the softmax log-sum-exp that a ring layout
    #: merges partial results with (its entry point and source); ``None``: it
    #: cannot, or no source says it can (fail closed). The built-in values are
    #: :data:`LSE_SOURCES`.
    lse: str | None = None
    #: issue 22: whether the varlen entry point's causal mask takes a sequence
    #: whose query and key lengths differ (aligned bottom-right, as attnres runs
    #: a bottom-right causal cross-attention layer through it); a fact its
    #: source states, ``False`` where it says causal needs equal lengths
    varlen_causal_unequal: bool = True
    #: issue 31: the kernel and distribution versions the fields above describe,
    #: with the source they were read from ("SageAttention 2/2++: sageattention
    #: >= 2.0 (thu-ml/SageAttention d1a57a54)"); shown by ``attnres backends``
    release: str = ""
    #: issue 31: facts that replace the fields above for other versions of the
    #: distribution or other GPUs (:class:`KernelFacts`; :func:`installed_facts`)
    variants: tuple[KernelFacts, ...] = field(default=(), converter=_variants)
    #: issue 31: option values the kernel refuses for some layers and devices
    option_limits: tuple[OptionLimit, ...] = field(default=(), converter=_option_limits)
    #: issue 31: what the kernel refuses at call time that no layer fact decides
    #: (a sequence length, a global torch mode), each with its source; shown by
    #: ``attnres backends`` and docs/backends.md
    refuses: tuple[str, ...] = field(default=(), converter=_str_tuple)
    #: issue 34: whether the kernel is exact to its dtype or lossy, and how, per
    #: version range and GPU (:class:`Precision`; the first that matches applies,
    #: :func:`precision_of`). Empty: the spec declares nothing (a budget of
    #: ``exact`` then refuses it: fail closed). The built-in values are
    #: :data:`PRECISION_FACTS`.
    precision: tuple[Precision, ...] = field(default=(), converter=_precisions)

    def __attrs_post_init__(self) -> None:
        if self.varlen_kernel is None and any(m.route is MaskRoute.UNPAD for m in self.masks):
            raise InvalidArgumentError(
                f"backend {self.name!r}: a mask taken by unpadding needs a varlen_kernel"
            )

    def mask_support(self, kind: MaskKind) -> MaskSupport | None:
        """How the kernel takes ``kind`` (``None``: it does not).

        ``any`` (0.2's ``attn_mask``) needs boolean and additive masks natively;
        a spec that implements ``attn_mask`` and declares nothing for a kind
        takes it natively.
        """
        if kind is MaskKind.NONE:
            raise InvalidArgumentError("mask_support: a layer with no mask needs no mask support")
        if kind is MaskKind.ANY:
            parts = [self.mask_support(k) for k in (MaskKind.BOOLEAN, MaskKind.ADDITIVE)]
            if all(p is not None and p.route is MaskRoute.NATIVE for p in parts):
                return parts[1]
            return None
        for support in self.masks:
            if support.kind is kind:
                return support
        if Requirement.ATTN_MASK in self.implements:
            return MaskSupport(kind, MaskRoute.NATIVE, _LEGACY_MASK_SOURCE)
        return None

    @property
    def packages(self) -> tuple[str, ...]:
        """Every optional package the spec names (probed on every platform)."""
        first = () if self.package is None else (self.package,)
        return (*first, *self.package_alternatives, *self.extra_packages)

    @name.validator
    def _check_name(self, _: attrs.Attribute[str], value: str) -> None:
        if not _NAME_RE.fullmatch(value):
            raise InvalidArgumentError(
                f"backend name must be lower-case letters, digits and '_', got {value!r}"
            )

    @property
    def kind(self) -> str:
        return "sparse" if self.sparse else "dense"

    @property
    def backend(self) -> Backend:
        return Backend(self.name)


_ALL = PLATFORM_KINDS
_HALF = ("float16", "bfloat16")
_FULL = ("float16", "bfloat16", "float32", "float64")
R = Requirement
_AMPERE_UP = CapabilityRule(min=(8, 0))
_HOPPER = CapabilityRule(exact={(9, 0)})
#: sliding windows where attnres's adapter builds them as a mask (docs/backends.md)
_WINDOW = R.SLIDING_WINDOW
#: what the flash-attn family's kernels take (fa adds dropout; aiter has no softcap)
_FLASH = (R.CAUSAL, R.GQA, R.PACKED_VARLEN, R.BACKWARD, R.CUSTOM_SCALE, R.SOFTCAP, R.SLIDING_WINDOW)
#: what torch SDPA's arguments express (the kernels that take them as SDPA does)
_SDPA = (R.CAUSAL, R.ATTN_MASK, R.GQA, R.DROPOUT, R.BACKWARD, R.CUSTOM_SCALE, _WINDOW)


def _unpad(source: str) -> tuple[MaskSupport, ...]:
    """Key padding taken by unpadding (the spec's ``varlen_kernel``), and no other mask."""
    return (MaskSupport(MaskKind.KEY_PADDING, MaskRoute.UNPAD, source),)


def _native_masks(source: str) -> tuple[MaskSupport, ...]:
    """Key padding, boolean and additive masks, all taken as the kernel's mask argument."""
    kinds = (MaskKind.KEY_PADDING, MaskKind.BOOLEAN, MaskKind.ADDITIVE)
    return tuple(MaskSupport(kind, MaskRoute.NATIVE, source) for kind in kinds)


#: issue 23: where each backend option was read (BackendOption.source; docs/backends.md)
_FA2_SIGNATURE = (
    "flash-attention flash_attn/flash_attn_interface.py: flash_attn_func(..., deterministic=False)"
)
_FA3_SIGNATURE = (
    "flash-attention hopper/flash_attn_interface.py: "
    "flash_attn_func(..., pack_gqa=None, deterministic=False)"
)
_FA4_SIGNATURE = (
    "flash-attention flash_attn/cute/interface.py: "
    "flash_attn_func(..., pack_gqa=None, deterministic=False)"
)


def _deterministic(signature: str) -> BackendOption:
    """The flash-attn family's ``deterministic=False`` option, read from ``signature``."""
    return BackendOption("deterministic", "bool", False, signature)


def _pack_gqa(signature: str) -> BackendOption:
    """The flash-attn family's ``pack_gqa=None`` option, read from ``signature``."""
    return BackendOption("pack_gqa", "bool", None, signature, nullable=True)


#: issue 31: the releases the built-in facts were read from (docs/backends.md)
_FA4_B36 = "flash-attn-4 4.0.0b36 (registry wheel) flash_attn/cute/interface.py"
_FA_CUTE_EARLY = "flash-attn 2.8.3 (registry sdist) flash_attn/cute/interface.py (cute 0.1.0)"
_SAGE1 = "sageattention 1.0.6 (registry wheel) sageattention/core.py"
_FA3_BWD = (
    "flash-attention hopper/flash_api.cpp mha_bwd: deterministic needs head_size_rounded "
    "< 256, else 'Deterministic backward not supported for hdim 256.'; round_up_headdim "
    "takes 193-256 to 256"
)

#: issue 23: SageAttention 2's functions per GPU, read at thu-ml/SageAttention
#: d1a57a54, sageattention/core.py. ``sageattn`` picks one by
#: ``torch.cuda.get_device_capability`` (``get_cuda_arch_versions``) and passes
#: the settings in ``passes``; its ``**kwargs`` are never forwarded.
_SAGE_CORE = "SageAttention d1a57a54 sageattention/core.py: "
_QK_QUANT_GRAN = ("per_warp", "per_thread")  # assert qk_quant_gran in [...] (each CUDA entry)


def _sage_option(
    name: str, kind: str, default: OptionValue, signature: str, choices: tuple[str, ...] = ()
) -> BackendOption:
    return BackendOption(name, kind, default, _SAGE_CORE + signature, choices=choices)


def _smoothing(signature: str, smooth_v: bool = True) -> tuple[BackendOption, ...]:
    """``smooth_k=True`` (and ``smooth_v=False``) as the function of ``signature`` takes them."""
    k = _sage_option("smooth_k", "bool", True, signature)
    return (k, _sage_option("smooth_v", "bool", False, signature)) if smooth_v else (k,)


_SAGE_FP16_CUDA = (
    "sageattn_qk_int8_pv_fp16_cuda(..., qk_quant_gran='per_thread', "
    "pv_accum_dtype='fp32', smooth_k=True, smooth_v=False, ...)"
)
_SAGE_FP8_CUDA = (
    "sageattn_qk_int8_pv_fp8_cuda(..., qk_quant_gran='per_thread', "
    "pv_accum_dtype='fp32+fp16', smooth_k=True, smooth_v=False, ...)"
)
_SAGE_FP8_SM90 = (
    "sageattn_qk_int8_pv_fp8_cuda_sm90(..., qk_quant_gran='per_thread', "
    "pv_accum_dtype='fp32+fp32', smooth_k=True, ...)"
)
_SAGE_TRITON = "sageattn_qk_int8_pv_fp16_triton(..., quantization_backend='triton', smooth_k=True)"
_SAGE_VARLEN = "sageattn_varlen(..., is_causal=False, sm_scale=None, smooth_k=True, **kwargs)"


def _sage_fp8_cuda(
    capabilities: set[tuple[int, int]],
    grans: tuple[str, ...],
    passes: tuple[tuple[str, OptionValue], ...],
    why: str = "",
) -> EntryPoint:
    return EntryPoint(
        "sageattn_qk_int8_pv_fp8_cuda",
        _SAGE_CORE + _SAGE_FP8_CUDA,
        (
            _sage_option("qk_quant_gran", "str", "per_thread", _SAGE_FP8_CUDA + why, grans),
            # the branches of its body; another value leaves its output unset
            _sage_option(
                "pv_accum_dtype",
                "str",
                "fp32+fp16",
                _SAGE_FP8_CUDA,
                ("fp32", "fp32+fp32", "fp32+fp16"),
            ),
            *_smoothing(_SAGE_FP8_CUDA),
        ),
        capabilities,
        passes,
    )


_SAGE_ENTRY_POINTS = (
    EntryPoint(
        "sageattn_qk_int8_pv_fp16_cuda",
        _SAGE_CORE + _SAGE_FP16_CUDA,
        (
            _sage_option("qk_quant_gran", "str", "per_thread", _SAGE_FP16_CUDA, _QK_QUANT_GRAN),
            # "either 'fp16', 'fp16+fp32' or 'fp32'"; another value raises
            # "Unsupported pv_accum_dtype"
            _sage_option(
                "pv_accum_dtype", "str", "fp32", _SAGE_FP16_CUDA, ("fp32", "fp16", "fp16+fp32")
            ),
            *_smoothing(_SAGE_FP16_CUDA),
        ),
        {(8, 0)},
        (("pv_accum_dtype", "fp32"),),
    ),
    EntryPoint(
        "sageattn_qk_int8_pv_fp16_triton",
        _SAGE_CORE + _SAGE_TRITON,
        (
            # "either 'triton' or 'cuda'"; another raises "Unsupported quantization backend"
            _sage_option("quantization_backend", "str", "triton", _SAGE_TRITON, ("triton", "cuda")),
            *_smoothing(_SAGE_TRITON, smooth_v=False),
        ),
        {(8, 6)},
    ),
    _sage_fp8_cuda({(8, 9)}, _QK_QUANT_GRAN, (("pv_accum_dtype", "fp32+fp16"),)),
    EntryPoint(
        "sageattn_qk_int8_pv_fp8_cuda_sm90",
        _SAGE_CORE + _SAGE_FP8_SM90,
        (
            _sage_option("qk_quant_gran", "str", "per_thread", _SAGE_FP8_SM90, _QK_QUANT_GRAN),
            # "fp32" raises "Please use pv_accum_dtype='fp32+fp32' for sm90."
            _sage_option("pv_accum_dtype", "str", "fp32+fp32", _SAGE_FP8_SM90, ("fp32+fp32",)),
            *_smoothing(_SAGE_FP8_SM90, smooth_v=False),
        ),
        {(9, 0)},
        (("pv_accum_dtype", "fp32+fp32"),),
    ),
    # sm120/sm121: sageattn passes qk_quant_gran="per_warp" because "triton kernel
    # is currently not usable on sm120" ('per_thread' quantises with the Triton
    # per_thread_int8), so only 'per_warp' is taken there
    _sage_fp8_cuda(
        {(12, 0), (12, 1)},
        ("per_warp",),
        (("pv_accum_dtype", "fp32+fp16"), ("qk_quant_gran", "per_warp")),
        "; sageattn passes 'per_warp' on sm120/sm121: 'triton kernel is currently not "
        "usable on sm120'",
    ),
    EntryPoint(
        "sageattn_varlen",
        _SAGE_CORE + _SAGE_VARLEN,
        _smoothing(_SAGE_VARLEN, smooth_v=False),
        varlen=True,
    ),
)


def _declared_sage_options(entries: Iterable[EntryPoint]) -> tuple[BackendOption, ...]:
    """One declared option per name over ``entries``: every value one of them takes;
    the default is per GPU (``None``), its source names the functions."""
    found: dict[str, list[BackendOption]] = {}
    for entry in entries:
        for option in entry.options:
            found.setdefault(option.name, []).append(option)
    out = []
    for name, options in found.items():
        choices = tuple(dict.fromkeys(c for o in options for c in o.choices))
        where = sorted({o.source.removeprefix(_SAGE_CORE).partition("(")[0] for o in options})
        out.append(
            BackendOption(
                name,
                options[0].kind,
                None,
                _SAGE_CORE + ", ".join(where) + " (per GPU: docs/backends.md)",
                choices=choices,
            )
        )
    return tuple(out)


#: The built-in specs before their log-sum-exp facts (:data:`LSE_SOURCES`) are added.
_CATALOGUE: tuple[BackendSpec, ...] = (
    BackendSpec(
        name="torch_sdpa",
        sparse=False,
        platforms=_ALL,
        dtypes=_FULL,
        implements=_SDPA,
        aliases=("sdpa", "torch", "native", "torch_native", "scaled_dot_product_attention"),
        description="torch.nn.functional.scaled_dot_product_attention",
        release="torch (the installed build; torch docs for scaled_dot_product_attention)",
        kernel="attnres.kernels.torch_sdpa:make_kernel",
        masks=_native_masks(
            "torch.nn.functional.scaled_dot_product_attention: attn_mask is a boolean mask "
            "(True takes part) or a float bias added to the scores (torch docs)"
        ),
    ),
    BackendSpec(
        name="eager",
        sparse=False,
        platforms=_ALL,
        dtypes=_FULL,
        implements=(
            *_SDPA,
            R.SOFTCAP,
            # issue 19: a sink is one more logit per head in every row's softmax
            # (attnres.kernels.eager's ``sinks``; GPT-OSS's eager_attention_forward,
            # transformers 5.24, computes the same)
            R.SINKS,
            # issue 19: the weights are its softmax matrix (torch's MultiheadAttention
            # computes them with this math, softmax of a bmm, on its own path)
            R.WEIGHTS,
        ),
        aliases=("math", "reference"),
        description="reference math: matmul, softmax, matmul (float32 accumulation)",
        release="attnres itself (attnres.kernels.eager)",
        kernel="attnres.kernels.eager:make_kernel",
        masks=_native_masks("attnres.kernels.eager: masked_fill for boolean, + for float masks"),
    ),
    BackendSpec(
        name="torch_cudnn_sdpa",
        sparse=False,
        platforms=("cuda",),
        dtypes=_HALF,
        head_sizes=HeadSizeRule(max=128, multiple_of=8),
        implements=_SDPA,
        capabilities={"cuda": CapabilityRule(min=(8, 0), max=(12, 1))},
        satisfies=[{"torch_sdpa"}],
        aliases=("cudnn", "cudnn_sdpa"),
        description="torch SDPA restricted to the cuDNN backend",
        release=(
            "torch >= 2.5 (pytorch aten/src/ATen/native/transformers/cuda/sdp_utils.cpp 001f694a)"
        ),
        # issue 31: enforced by the adapter (attnres.kernels.torch_cudnn_sdpa), which
        # raises KernelRefusedError before torch's "No available kernel"
        refuses=(
            "a key/value sequence of length 1 (seq_kv == 1): sdp_utils.cpp (pytorch "
            "001f694a) check_cudnn_tensor_shapes: 'cudnn SDPA does not support key/value "
            "sequence length 1'; the adapter raises KernelRefusedError (torch would raise "
            "'No available kernel' with only cuDNN enabled)",
            "torch.use_deterministic_algorithms(True) without warn_only: sdp_utils.cpp "
            "(pytorch 001f694a) check_cudnn_deterministic: 'cuDNN SDPA is not "
            "deterministic'; the adapter raises KernelRefusedError",
        ),
        kernel="attnres.kernels.torch_cudnn_sdpa:make_kernel",
    ),
    BackendSpec(
        name="dynamic_cudnn_sdpa",
        sparse=False,
        platforms=("cuda",),
        dtypes=_HALF,
        head_sizes=HeadSizeRule(max=128, multiple_of=8),
        implements=(R.CAUSAL, R.ATTN_MASK, R.GQA, R.DROPOUT),
        capabilities={"cuda": CapabilityRule(min=(8, 0), max=(12, 1))},
        satisfies=[{"fa", "torch_sdpa"}],
        aliases=("dynamic_cudnn",),
        description="cuDNN SDPA chosen per shape, standing in for fa and torch_sdpa",
        release="no upstream source found: its facts are unverified (docs/backends.md)",
        kernel="attnres.kernels.dynamic_cudnn_sdpa:make_kernel",
    ),
    BackendSpec(
        name="flex_attention",
        sparse=False,
        platforms=("cpu", "cuda"),
        dtypes=("float16", "bfloat16", "float32"),
        head_sizes=HeadSizeRule(min=16, max=1024, power_of_two=True),
        implements=(R.CAUSAL, R.ATTN_MASK, R.GQA, R.BACKWARD, R.CUSTOM_SCALE, R.SOFTCAP, _WINDOW),
        limits=(
            RequirementLimit(
                {R.BACKWARD},
                "flex_attention.py: 'FlexAttention does not support backward on CPU'",
                platforms={"cpu"},
            ),
        ),
        min_torch={"cuda": (2, 5), "cpu": (2, 6)},
        aliases=("flex",),
        description="torch.nn.attention.flex_attention",
        release="torch >= 2.5 on cuda, >= 2.6 on cpu (torch/nn/attention/flex_attention.py)",
        kernel="attnres.kernels.flex_attention:make_kernel",
        masks=_native_masks(
            "torch/nn/attention/flex_attention.py: boolean masks as a BlockMask from mask_mod, "
            "float masks as a score_mod bias (attnres.kernels.flex_attention)"
        ),
    ),
    BackendSpec(
        name="fa",
        sparse=False,
        options=(_deterministic(_FA2_SIGNATURE),),
        platforms=("cuda", "rocm"),
        dtypes=_HALF,
        head_sizes=HeadSizeRule(max=256),
        implements=(*_FLASH, R.DROPOUT),
        limits=(
            RequirementLimit(
                {R.SOFTCAP, R.DROPOUT},
                "flash_api.cpp: 'Softcapping does not support dropout for now'",
            ),
            RequirementLimit(
                {R.SOFTCAP},
                "unverified for the ROCm builds; the Triton one raises 'Softcap is not yet "
                "supported in the AMD Triton backend'",
                platforms={"rocm"},
            ),
            RequirementLimit(
                {R.SLIDING_WINDOW}, "unverified for the ROCm builds", platforms={"rocm"}
            ),
        ),
        package="flash_attn",
        capabilities={
            "cuda": _AMPERE_UP,
            "rocm": CapabilityRule(archs={"gfx90a", "gfx942", "gfx950"}),
        },
        aliases=("flash_attn", "flash_attention", "flash_attention_2", "fa2", "flash_attn_2"),
        description="flash-attn 2.x (flash_attn_func / flash_attn_varlen_func)",
        release=(
            "flash-attn >= 2.0 (flash-attention 0251105a; setup.py builds sm80-sm120 from v2.7.3)"
        ),
        causal_top_left=False,
        kernel="attnres.kernels.fa:make_kernel",
        masks=_unpad(
            "flash_attn/flash_attn_interface.py: flash_attn_varlen_func(q, k, v, "
            "cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, ...), int32 "
            "cu_seqlens; no mask argument (flash-attention 0251105a)"
        ),
        varlen_kernel="attnres.kernels.fa:make_varlen_kernel",
    ),
    BackendSpec(
        name="fa3",
        sparse=False,
        options=(_deterministic(_FA3_SIGNATURE), _pack_gqa(_FA3_SIGNATURE)),
        platforms=("cuda",),
        dtypes=_HALF,  # fp8 left out: it needs head sizes % 16 (docs/backends.md)
        head_sizes=HeadSizeRule(max=256, multiple_of=8),
        implements=_FLASH,
        package="flash_attn_interface",
        capabilities={"cuda": _HOPPER},
        aliases=("flash_attn_3", "flash_attention_3"),
        description="FlashAttention-3 (flash_attn_interface, built from hopper/)",
        release="flash_attn_3 built from hopper/ (flash-attention c082294e; not on the registry)",
        option_limits=(
            OptionLimit(
                "deterministic",
                True,
                _FA3_BWD,
                requirements={R.BACKWARD},
                head_sizes=HeadSizeRule(min=193, max=256),
            ),
        ),
        causal_top_left=False,
        kernel="attnres.kernels.fa3:make_kernel",
        masks=_unpad(
            "hopper/flash_attn_interface.py: flash_attn_varlen_func(q, k, v, cu_seqlens_q, "
            "cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None, seqused_k=None, "
            "softmax_scale=None, causal=False, ...) (flash-attention c082294e)"
        ),
        varlen_kernel="attnres.kernels.fa3:make_varlen_kernel",
    ),
    BackendSpec(
        name="fa4",
        sparse=False,
        options=(_deterministic(_FA4_SIGNATURE), _pack_gqa(_FA4_SIGNATURE)),
        platforms=("cuda",),
        dtypes=_HALF,
        head_sizes=HeadSizeRule(max=128, multiple_of=8),
        implements=_FLASH,
        limits=(
            RequirementLimit(
                {R.BACKWARD},
                f"{_FA4_B36}: _flash_attn_bwd asserts arch // 10 in [9, 10, 11, 12] (forward "
                "runs on 8.x)",
                capabilities=CapabilityRule(min=(8, 0), max=(8, 9)),
            ),
        ),
        package="flash_attn_4",
        # _flash_attn_fwd: assert arch // 10 in [8, 9, 10, 11, 12]
        capabilities={"cuda": CapabilityRule(min=(8, 0), max=(12, 1))},
        release=(
            f"FlashAttention-4: flash-attn-4 4.0.0 pre-releases ({_FA4_B36}; sm120 from "
            "fa4-v4.0.0.beta5)"
        ),
        option_limits=(
            OptionLimit(
                "deterministic",
                True,
                f"{_FA4_B36} _flash_attn_bwd: 'deterministic backward not supported on SM 12.0'",
                requirements={R.BACKWARD},
                capabilities=CapabilityRule(min=(12, 0), max=(12, 1)),
            ),
        ),
        variants=(
            KernelFacts(
                "FlashAttention-4 on sm90",
                f"{_FA4_B36} _validate_head_dims: on SM90 head_dim and head_dim_v 8-256, "
                "divisible by 8 (16-bit inputs)",
                {"head_sizes": HeadSizeRule(min=8, max=256, multiple_of=8)},
                capabilities=CapabilityRule(min=(9, 0), max=(9, 9)),
            ),
            KernelFacts(
                "FlashAttention-4 on sm100/sm110",
                f"{_FA4_B36} _validate_head_dims: on SM100/SM110 8-128 divisible by 8, or "
                "(256, 256) (and (192, 128), a different value head size attnres does not "
                "model); fp8 forward only here ('FP8 is only supported on SM100'), not "
                "modelled: attnres's dtypes are 16-bit",
                {"head_sizes": HeadSizeRule(allowed={*range(8, 129, 8), 256})},
                capabilities=CapabilityRule(min=(10, 0), max=(11, 9)),
            ),
            KernelFacts(
                "flash-attn 2.x's early flash_attn.cute (0.1.0)",
                f"{_FA_CUTE_EARLY}: _flash_attn_fwd asserts compute capability 9.x or 10.x; "
                "flash_attn_func(q, k, v, softmax_scale, causal, window_size, learnable_sink, "
                "softcap, pack_gqa) takes no deterministic; flash_attn_varlen_func has no "
                "max_seqlen_q/max_seqlen_k and returns no lse; no backward pass: "
                "FlashAttnFunc.backward returns 8 gradients for the forward's 9 inputs and "
                "FlashAttnVarlenFunc.backward raises NotImplementedError (the adapter "
                "refuses a call that needs gradients: KernelRefusedError)",
                {
                    "capabilities": FrozenMap({"cuda": CapabilityRule(min=(9, 0), max=(10, 9))}),
                    "head_sizes": HeadSizeRule(max=128, multiple_of=8),
                    "implements": frozenset(
                        {R.CAUSAL, R.GQA, R.CUSTOM_SCALE, R.SOFTCAP, R.SLIDING_WINDOW}
                    ),
                    "limits": (),
                    "masks": (),
                    "varlen_kernel": None,
                    "options": (
                        _pack_gqa(f"{_FA_CUTE_EARLY}: flash_attn_func(..., pack_gqa=None)"),
                    ),
                    "option_limits": (),
                    "lse": None,
                },
                distribution="flash-attn",
            ),
        ),
        aliases=("flash_attn_4", "flash_attention_4", "flash_attn_cute"),
        description="FlashAttention-4 (flash_attn.cute, PyPI flash-attn-4)",
        causal_top_left=False,
        kernel="attnres.kernels.fa4:make_kernel",
        masks=_unpad(
            "flash_attn/cute/interface.py: flash_attn_varlen_func(q, k, v, qv=None, "
            "cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, "
            "...), int32 contiguous cu_seqlens; masks only as CuTe mask_mod "
            "(flash-attention 0251105a)"
        ),
        varlen_kernel="attnres.kernels.fa4:make_varlen_kernel",
    ),
    BackendSpec(
        name="sage_attn",
        sparse=False,
        platforms=("cuda",),
        dtypes=_HALF,
        head_sizes=HeadSizeRule(max=128),
        implements=(R.CAUSAL, R.GQA, R.CUSTOM_SCALE),
        package="sageattention",
        capabilities={
            "cuda": CapabilityRule(exact={(8, 0), (8, 6), (8, 9), (9, 0), (12, 0), (12, 1)})
        },
        aliases=("sage", "sageattention", "sage_attention", "sageattn"),
        description="SageAttention 2/2++ (sageattention.sageattn)",
        release=(
            "SageAttention 2/2++: sageattention >= 2.0 (thu-ml/SageAttention d1a57a54, built "
            "from source; the registry has 1.0.6 only)"
        ),
        variants=(
            KernelFacts(
                "SageAttention 1",
                f"{_SAGE1}: sageattn asserts headdim in [64, 96, 128] and takes fp16/bf16/fp32 "
                "(Triton kernels, fp16 PV accumulation; no capability dispatch, README: "
                "'optimized for RTX4090 and RTX3090'); sageattn(q, k, v, tensor_layout, "
                "is_causal, sm_scale, smooth_k) has no per-GPU functions and no return_lse; "
                "sageattn_varlen asserts head_dim in [64, 128]",
                {
                    "head_sizes": HeadSizeRule(allowed={64, 96, 128}),
                    "capabilities": FrozenMap({"cuda": _AMPERE_UP}),
                    "entry_points": (),
                    "options": (
                        BackendOption(
                            "smooth_k", "bool", True, f"{_SAGE1}: sageattn(..., smooth_k=True)"
                        ),
                    ),
                    # sageattn_varlen takes head sizes 64 and 128 only, sageattn 96 too:
                    # attnres keeps key padding off SageAttention 1 (fail closed)
                    "masks": (),
                    "varlen_kernel": None,
                    "lse": None,
                },
                distribution="sageattention",
                before="2",
            ),
            KernelFacts(
                "SageAttention 2 on sm120/sm121",
                f"{_SAGE_CORE}sageattn_varlen runs the Triton per_block_int8 quantisation, "
                "which sageattn's own sm120 branch avoids: 'triton kernel is currently not "
                "usable on sm120'; key padding is not taken there",
                {"masks": (), "varlen_kernel": None},
                capabilities=CapabilityRule(min=(12, 0), max=(12, 1)),
            ),
        ),
        causal_top_left=False,
        kernel="attnres.kernels.sage_attn:make_kernel",
        # issue 23: sageattn drops keyword arguments it does not know, so options
        # go to the function it runs on the device (docs/backends.md)
        options=_declared_sage_options(_SAGE_ENTRY_POINTS),
        entry_points=_SAGE_ENTRY_POINTS,
        masks=_unpad(
            "sageattention/core.py: sageattn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, "
            "max_seqlen_q, max_seqlen_k, is_causal=False, sm_scale=None, smooth_k=True) "
            "(Triton); sageattn itself drops attn_mask (SageAttention d1a57a54)"
        ),
        varlen_kernel="attnres.kernels.sage_attn:make_varlen_kernel",
        # sageattention/core.py, sageattn_varlen's docstring: is_causal is "Only applicable
        # when qo_len == kv_len for each sequence" (SageAttention d1a57a54)
        varlen_causal_unequal=False,
    ),
    BackendSpec(
        name="sage_attn_3",
        sparse=False,
        platforms=("cuda",),
        dtypes=_HALF,
        head_sizes=HeadSizeRule(allowed={64, 128}),
        implements=(R.CAUSAL,),
        package="sageattn3",
        capabilities={"cuda": CapabilityRule(exact={(12, 0), (12, 1)})},
        aliases=("sage3", "sageattn3", "sage_attention_3"),
        description="SageAttention3 for Blackwell (sageattn3)",
        release=(
            "sageattn3 built from sageattention3_blackwell/ (SageAttention d1a57a54; not on "
            "the registry)"
        ),
        causal_top_left=False,
        kernel="attnres.kernels.sage_attn_3:make_kernel",
    ),
    BackendSpec(
        name="xformers",
        sparse=False,
        platforms=("cuda",),
        dtypes=("float16", "bfloat16", "float32"),
        head_sizes=HeadSizeRule(multiple_of=8),
        implements=(*_SDPA, R.PACKED_VARLEN),
        limits=(
            RequirementLimit(
                {R.BACKWARD, R.GQA},
                "the cutlass forward op takes the 5-D GQA layout, its backward op does not",
            ),
        ),
        package="xformers",
        capabilities={"cuda": CapabilityRule(min=(5, 0), max=(9, 0))},
        dtype_capabilities={"bfloat16": _AMPERE_UP},
        aliases=("xformers_attn", "memory_efficient_attention"),
        description="xformers.ops.memory_efficient_attention (cutlass)",
        release="xformers up to ce4f89d5 (the last before its attention moved to mslk)",
        kernel="attnres.kernels.xformers:make_kernel",
        masks=_native_masks(
            "xformers/ops/fmha: attn_bias is a float tensor bias; attnres.kernels.xformers turns "
            "a boolean mask into a 0/-inf bias (BlockDiagonalPaddedKeysMask is the packed form)"
        ),
    ),
    BackendSpec(
        name="aiter",
        sparse=False,
        platforms=("rocm",),
        dtypes=_HALF,
        head_sizes=HeadSizeRule(max=256),
        implements={*_FLASH, R.DROPOUT} - {R.SOFTCAP},  # no softcap argument
        package="aiter",
        capabilities={"rocm": CapabilityRule(archs={"gfx942", "gfx950"})},
        aliases=("aiter_fa", "rocm_aiter"),
        description="AMD aiter flash attention (aiter.flash_attn_func)",
        release="amd-aiter (ROCm/aiter e4048607; registry amd-aiter 0.1.7.post2.dev18)",
        causal_top_left=False,
        kernel="attnres.kernels.aiter:make_kernel",
        masks=_unpad(
            "aiter/ops/mha.py: flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, "
            "max_seqlen_q, max_seqlen_k, min_seqlen_q=0, dropout_p=0.0, ...), int32 "
            "cu_seqlens (mha_varlen_fwd_kernels.cu); its bias is one (seqlen_q, seqlen_k) "
            "tensor, not a per-row mask (ROCm/aiter e4048607)"
        ),
        varlen_kernel="attnres.kernels.aiter:make_varlen_kernel",
    ),
    BackendSpec(
        name="ascend_fa",
        sparse=False,
        platforms=("npu",),
        dtypes=_HALF,
        head_sizes=HeadSizeRule(max=512, multiple_of=16),
        # no attn_mask claim: only the boolean kind below (an undeclared kind would
        # otherwise count as taken natively)
        implements=(R.CAUSAL, R.GQA, R.PACKED_VARLEN, R.DROPOUT, R.CUSTOM_SCALE),
        package="torch_npu",
        # atten_mask is BOOL/UINT8 only (True masks out): the adapter inverts a boolean
        # mask and refuses every float one, key padding in 0/-inf form included
        masks=(
            MaskSupport(
                MaskKind.BOOLEAN,
                MaskRoute.NATIVE,
                "torch_npu npu_fusion_attention: atten_mask is BOOL or UINT8 (True masks a "
                "position out); no additive mask (attnres.kernels.ascend_fa refuses float masks)",
            ),
        ),
        release=(
            "torch-npu 2.13.0 (registry wheel; torch_npu/_op_plugin_docs.py, "
            "npu_fusion_attention: BOOL/UINT8 atten_mask, head dim 1-768, the catalogue "
            "keeps multiples of 16 up to 512 from the Ascend op-plugin docs)"
        ),
        aliases=("npu_fa", "npu_fusion_attention", "ascend"),
        description="Ascend torch_npu.npu_fusion_attention",
        kernel="attnres.kernels.ascend_fa:make_kernel",
    ),
    BackendSpec(
        name="sliding_tile_attn",
        sparse=True,
        platforms=("cuda",),
        dtypes=("bfloat16",),
        head_sizes=HeadSizeRule(allowed={64, 128}),
        package="fastvideo_kernel",
        package_alternatives=("st_attn",),
        capabilities={"cuda": _HOPPER},
        aliases=("sta", "sliding_tile_attention"),
        description="Sliding Tile Attention (FastVideo fastvideo_kernel, formerly st_attn)",
        release="fastvideo-kernel (FastVideo 2f3d4074), or the older separate module",
    ),
    BackendSpec(
        name="video_sparse_attn",
        sparse=True,
        platforms=("cuda",),
        dtypes=("bfloat16",),
        head_sizes=HeadSizeRule(allowed={64, 128}),
        implements=(R.BACKWARD,),
        package="fastvideo_kernel",
        package_alternatives=("vsa",),
        capabilities={"cuda": CapabilityRule(exact={(9, 0), (10, 0)})},
        aliases=("vsa", "video_sparse_attention"),
        description="Video Sparse Attention (FastVideo fastvideo_kernel, formerly vsa)",
        release="fastvideo-kernel (FastVideo 2f3d4074), or the older separate module",
    ),
    BackendSpec(
        name="vmoba_attn",
        sparse=True,
        platforms=("cuda",),
        dtypes=_HALF,
        # flash-attn's private varlen forward, without the wrapper's padding
        head_sizes=HeadSizeRule(max=256, multiple_of=8),
        implements=(R.BACKWARD,),
        package="fastvideo_kernel",
        package_alternatives=("vmoba",),
        extra_packages=("flash_attn",),
        capabilities={"cuda": _AMPERE_UP},
        aliases=("vmoba",),
        description="VMoBA sparse attention (FastVideo fastvideo_kernel) over flash-attn varlen",
        release="fastvideo-kernel (FastVideo 2f3d4074), or the older separate module",
    ),
    BackendSpec(
        name="sparse_video_gen_2_attn",
        sparse=True,
        platforms=("cuda",),
        dtypes=_HALF,
        head_sizes=HeadSizeRule(allowed={64, 128, 256}),
        package="svg",
        capabilities={"cuda": _HOPPER},
        aliases=("svg2", "sparse_videogen_2", "svg"),
        description="Sparse VideoGen 2 (svg)",
        release="svg built from svg-project/Sparse-VideoGen (kernels for sm90a; unverified beyond)",
    ),
)


#: Issue 24: which kernels return the softmax log-sum-exp a ring layout merges
#: partial results with, and where each source says so (``BackendSpec.lse``).
#: A backend not listed cannot (or no source read says it can: fail closed):
#: ``sage_attn_3`` (the sageattn3_blackwell API has no lse output), ``xformers``
#: (``memory_efficient_attention`` returns the output only), ``dynamic_cudnn_sdpa``
#: (no upstream source), ``ascend_fa`` (``npu_fusion_attention`` returns
#: softmax_max/softmax_sum; unverified), the sparse kernels.
LSE_SOURCES: Mapping[str, str] = {
    "torch_sdpa": (
        "torch's fused entry points return (output, logsumexp): "
        "aten::_scaled_dot_product_flash_attention_for_cpu on CPU, "
        "_scaled_dot_product_flash_attention and _scaled_dot_product_efficient_attention"
        "(compute_log_sumexp=True) on CUDA (pytorch native_functions.yaml)"
    ),
    "eager": "attnres's reference math computes it (torch.logsumexp of the scaled scores)",
    "torch_cudnn_sdpa": (
        "_scaled_dot_product_cudnn_attention(compute_log_sumexp=True) returns logsumexp "
        "(pytorch native_functions.yaml)"
    ),
    "flex_attention": (
        "flex_attention(..., return_aux=AuxRequest(lse=True)) returns (out, aux) with "
        "aux.lse; return_lse=True, its older form, is deprecated ('will be removed in "
        "v2.10') (torch/nn/attention/flex_attention.py, torch 2.13)"
    ),
    "fa": (
        "flash_attn_func(..., return_attn_probs=True) returns (out, softmax_lse, S_dmask) "
        "(flash_attn/flash_attn_interface.py)"
    ),
    "fa3": (
        "hopper/flash_attn_interface.py: _flash_attn_forward returns softmax_lse; the "
        "public flash_attn_func of the hopper/ shipped with flash-attn 2.8.3 returns out "
        "only (FlashAttnFunc.forward), so an lse adapter calls the private function"
    ),
    "fa4": (
        "flash_attn.cute.flash_attn_func(..., return_lse=True) returns (out, lse); without "
        "it, lse only when an input requires grad (flash-attn-4 4.0.0b36 "
        "flash_attn/cute/interface.py)"
    ),
    "sage_attn": (
        "sageattn(..., return_lse=True) returns (out, lse), 'used for cases like Ring "
        "Attention' (sageattention/core.py, thu-ml/SageAttention 0116592f)"
    ),
    "aiter": "aiter.flash_attn_func(..., return_lse=True) (aiter/ops/mha.py)",
}

# =============================================================================
# Issue 34: precision facts -- exact to the dtype, or lossy and how
# =============================================================================


def _exact(kernel: str, source: str) -> Precision:
    """An exact-to-its-dtype kernel: its facts hold for every version and GPU."""
    return Precision(
        False,
        KernelFacts(kernel, source),
        inputs="computes in the inputs' dtype",
        accumulator="fp32 softmax and accumulation",
    )


#: SageAttention 2/2++ at d1a57a54 (sageattention/core.py, quant.py,
#: triton/quant_per_thread.py), per the function ``sageattn`` runs on each GPU
#: (``_SAGE_ENTRY_POINTS``); the algorithm is the SageAttention2 paper's
#: (Zhang et al., ICML 2025, arXiv 2411.10958): K smoothed by subtracting its
#: mean over tokens, Q and K int8 with per-warp/per-thread scales, P and V fp8
#: e4m3 (V per channel) with a two-level fp32 accumulation.
_SAGE2_QK = (
    "Q, K int8 (K smoothed: its mean over tokens subtracted, smooth_k=True), "
    "qk_quant_gran='per_thread' scales: Q per thread of a {wq}-row warp, K per "
    "thread of a {bk}-row block"
)
_SAGE2_SRC = (
    "SageAttention d1a57a54 sageattention/core.py {fn} (per_thread_int8_triton("
    "BLKQ={bq}, WARPQ={wq}, BLKK={bk}), per_channel_fp8(scale_max={vmax})); "
    "SageAttention2 paper, arXiv 2411.10958"
)

_SAGE_PRECISION = (
    Precision(
        True,
        KernelFacts(
            "SageAttention 1",
            f"{_SAGE1}: per_block_int8 (BLKQ=128, BLKK=64, K minus its mean over tokens) and "
            "an fp16 P.V; SageAttention paper (Zhang et al., ICLR 2025, arXiv 2410.02367): "
            "'smooth K', INT8 QK, FP16 PV with an FP16 accumulator",
            distribution="sageattention",
            before="2",
        ),
        qk="Q, K int8 with per-block scales (128-row Q blocks, 64-row K blocks; K smoothed)",
        pv="P, V fp16",
        accumulator="fp16 P.V accumulation (fp32 softmax)",
    ),
    Precision(
        True,
        KernelFacts(
            "SageAttention 2 on sm80",
            _SAGE2_SRC.format(
                fn="sageattn_qk_int8_pv_fp16_cuda", bq=128, wq=32, bk=64, vmax="-"
            ).replace(", per_channel_fp8(scale_max=-)", ""),
            capabilities=CapabilityRule(exact={(8, 0)}),
        ),
        qk=_SAGE2_QK.format(wq=32, bk=64),
        pv="P, V fp16 (bf16 V is cast to fp16)",
        accumulator="fp32 P.V accumulation (pv_accum_dtype='fp32')",
    ),
    Precision(
        True,
        KernelFacts(
            "SageAttention 2 on sm86",
            "SageAttention d1a57a54 sageattention/core.py sageattn_qk_int8_pv_fp16_triton "
            "(per_block_int8(BLKQ=128, BLKK=64), Triton attn_qk_int8_per_block)",
            capabilities=CapabilityRule(exact={(8, 6)}),
        ),
        qk="Q, K int8 with per-block scales (128-row Q blocks, 64-row K blocks; K smoothed)",
        pv="P, V fp16",
        accumulator="fp32 P.V accumulation (Triton tl.dot)",
    ),
    Precision(
        True,
        KernelFacts(
            "SageAttention 2 on sm89/sm120/sm121",
            _SAGE2_SRC.format(
                fn="sageattn_qk_int8_pv_fp8_cuda(pv_accum_dtype='fp32+fp16')",
                bq=128,
                wq=32,
                bk=64,
                vmax=2.25,
            ),
            capabilities=CapabilityRule(exact={(8, 9), (12, 0), (12, 1)}),
        ),
        qk=_SAGE2_QK.format(wq=32, bk=64) + " (per_warp on sm120/sm121)",
        pv="P fp8 e4m3, V fp8 e4m3 with per-channel scales",
        accumulator="P.V in fp16 inside a block, fp32 across blocks (pv_accum_dtype='fp32+fp16')",
    ),
    Precision(
        True,
        KernelFacts(
            "SageAttention 2 on sm90",
            _SAGE2_SRC.format(
                fn="sageattn_qk_int8_pv_fp8_cuda_sm90(pv_accum_dtype='fp32+fp32')",
                bq=64,
                wq=16,
                bk=128,
                vmax=448,
            ),
            capabilities=CapabilityRule(exact={(9, 0)}),
        ),
        qk=_SAGE2_QK.format(wq=16, bk=128),
        pv="P fp8 e4m3, V fp8 e4m3 with per-channel scales",
        accumulator="P.V in fp32 inside a block and across blocks (pv_accum_dtype='fp32+fp32')",
    ),
    Precision(
        True,
        KernelFacts(
            "SageAttention 2 (GPU not known)",
            "SageAttention d1a57a54 sageattention/core.py: every function sageattn runs "
            "quantises Q and K to int8",
        ),
        qk="Q, K int8 (K smoothed); P.V per GPU (fp16 on sm80/sm86, fp8 on sm89/sm90/sm120)",
    ),
)

#: The kernels exact to their dtype on every version and GPU: (kernel, source).
_EXACT: Mapping[str, tuple[str, str]] = {
    "torch_sdpa": (
        "torch SDPA",
        "torch docs for scaled_dot_product_attention: flash, memory-efficient, cuDNN "
        "and math kernels compute in the inputs' dtype with fp32 softmax and "
        "accumulation for fp16/bf16 (sdp_utils.cpp picks among them; none quantises)",
    ),
    "eager": ("attnres reference math", "attnres.kernels.eager: float32 accumulation"),
    "torch_cudnn_sdpa": (
        "cuDNN SDPA",
        "pytorch _scaled_dot_product_cudnn_attention: fp16/bf16 inputs, fp32 softmax "
        "statistics (cuDNN frontend sdpa; fp8 is a separate cuDNN op torch does not call)",
    ),
    "dynamic_cudnn_sdpa": (
        "cuDNN SDPA per shape",
        "as torch_cudnn_sdpa (its facts are unverified)",
    ),
    "flex_attention": (
        "flex_attention",
        "torch/nn/attention/flex_attention.py: the generated kernel computes in the "
        "inputs' dtype, softmax in fp32",
    ),
    "fa": (
        "flash-attn 2",
        "flash-attention csrc/flash_attn/flash_api.cpp: fp16/bf16 only, fp32 "
        "accumulators (flash_fwd_kernel.h acc_o, softmax row_max/row_sum in float)",
    ),
    "fa3": (
        "FlashAttention-3 (fp16/bf16)",
        "flash-attention hopper/flash_attn_interface.py: fp8 e4m3 inputs are a separate "
        "path (q_descale/k_descale/v_descale) that attnres never passes; the layer's "
        "fp16/bf16 run with fp32 accumulation",
    ),
    "fa4": (
        "FlashAttention-4 (fp16/bf16)",
        "flash-attn-4 4.0.0b36 flash_attn/cute/interface.py: fp16/bf16 with fp32 "
        "accumulation; fp8 forward only on sm100 for fp8 inputs, which attnres never passes",
    ),
    "xformers": (
        "xFormers cutlass",
        "xformers ops/fmha/cutlass.py: fp32/fp16/bf16 inputs, fp32 accumulation "
        "(memory-efficient attention, no quantisation)",
    ),
    "aiter": (
        "aiter (fp16/bf16)",
        "ROCm/aiter aiter/ops/mha.py: fp16/bf16 flash attention with fp32 "
        "accumulation; its fp8 forward takes fp8 inputs, which attnres never passes",
    ),
    "ascend_fa": (
        "Ascend npu_fusion_attention",
        "torch_npu npu_fusion_attention docs: fp16/bf16 inputs, fp32 softmax "
        "(unverified beyond the docs)",
    ),
}

#: Issue 34: whether each built-in kernel is exact to its dtype or lossy, and
#: how, with the source each fact was read from (``BackendSpec.precision``;
#: docs/backends.md and docs/precision.md). The sparse kernels are left out:
#: they skip blocks of the attention matrix by design, which no error budget
#: over dense attention describes, so a budget of ``exact`` refuses them.
PRECISION_FACTS: Mapping[str, tuple[Precision, ...]] = {
    **{name: (_exact(*facts),) for name, facts in _EXACT.items()},
    "sage_attn": _SAGE_PRECISION,
    "sage_attn_3": (
        Precision(
            True,
            KernelFacts(
                "SageAttention3 (Blackwell)",
                "SageAttention d1a57a54 sageattention3_blackwell/sageattn3/api.py "
                "(scale_and_quant_fp4, fp4_quantization_4d.cu); SageAttention3 paper "
                "(Zhang et al., arXiv 2505.11594): microscaling FP4 attention",
            ),
            inputs="fp16/bf16 in",
            qk="Q, K fp4 e2m1 with one fp8 e4m3 scale per 16-element block (NVFP4 "
            "microscaling; K smoothed)",
            pv="P fp4 e2m1 (two-level scaling), V fp4 e2m1 with per-block fp8 scales",
            accumulator="fp32 accumulation",
        ),
    ),
}


def _with_facts(spec: BackendSpec) -> BackendSpec:
    changes: dict[str, Any] = {}
    if spec.name in LSE_SOURCES:
        changes["lse"] = LSE_SOURCES[spec.name]
    if spec.name in PRECISION_FACTS:
        changes["precision"] = PRECISION_FACTS[spec.name]
    return attrs.evolve(spec, **changes) if changes else spec


#: The built-in catalogue (SPEC 2a). Every fact is cited in docs/backends.md.
BUILTIN_SPECS: tuple[BackendSpec, ...] = tuple(_with_facts(spec) for spec in _CATALOGUE)


@functools.lru_cache(maxsize=256)
def installed_facts(
    spec: BackendSpec,
    distribution: str | None,
    version: str | None,
    kind: str,
    capability: tuple[int, int] | None,
) -> tuple[BackendSpec, tuple[KernelFacts, ...]]:
    """``spec`` as the installed kernel is on this device (issue 31), and the
    :class:`KernelFacts` entries that made it so (empty: the spec's own facts).

    ``distribution`` and ``version`` are the platform's facts for the spec's
    package (:class:`~attnres.platform.PackageFact`); every matching entry's
    changes apply, in the order the spec lists them.
    """
    applied = tuple(v for v in spec.variants if v.matches(distribution, version, kind, capability))
    if not applied:
        return spec, ()
    changes: dict[str, Any] = {}
    for entry in applied:
        changes.update(entry.changes)
    return attrs.evolve(spec, **changes), applied


@frozen
class PluginFailure:
    """A plugin entry point that could not be loaded, and why."""

    entry_point: str
    error: str


class _Registry:
    """Name -> spec, alias -> name, in registration order. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._specs: dict[str, BackendSpec] = {}
        self._aliases: dict[str, str] = {}
        self._order: dict[str, int] = {}
        self._failures: list[PluginFailure] = []
        self._plugins_loaded = False
        self._loading = False
        self._plugin_owner: dict[str, str] = {}
        #: bumped on every registration change: every memo of what the registry
        #: decides belongs to one generation (attnres._memo), none subscribes
        self.generation = 0
        for spec in BUILTIN_SPECS:
            self.add(spec)

    # -- registration -------------------------------------------------------
    def add(self, spec: BackendSpec, *, replace: bool = False, owner: str | None = None) -> None:
        if not isinstance(spec, BackendSpec):
            raise ArgumentTypeError(
                f"register_backend takes a BackendSpec, got {type(spec).__name__}"
            )
        with self._lock:
            names = (spec.name, *(_key(a) for a in spec.aliases))
            for n in names:
                taken = self._aliases.get(n)
                # replace=True overrides a backend of the same name only: taking
                # another backend's name or alias would leave that one unparseable.
                if taken is not None and taken != spec.name:
                    raise PluginError(
                        f"cannot register backend {spec.name!r}: the name {n!r} already "
                        f"belongs to backend {taken!r}; pick another name or alias"
                    )
            if spec.name in self._specs and not replace:
                prev = self._plugin_owner.get(spec.name, "the built-in catalogue")
                by = f" (from {owner})" if owner else ""
                raise PluginError(
                    f"backend {spec.name!r}{by} is already registered by {prev}; two "
                    f"registrations cannot claim one name (pass replace=True to override "
                    f"it deliberately)"
                )
            if spec.name in self._specs:
                old = self._specs[spec.name]
                for a in old.aliases:
                    if self._aliases.get(_key(a)) == spec.name:
                        del self._aliases[_key(a)]
            self._specs[spec.name] = spec
            # after a removal len() may repeat a live position: count past the top
            self._order.setdefault(spec.name, max(self._order.values(), default=-1) + 1)
            for n in names:
                self._aliases[n] = spec.name
            if owner:
                self._plugin_owner[spec.name] = owner
            self._changed()

    def remove(self, name: str) -> None:
        with self._lock:
            spec = self._specs.pop(name, None)
            if spec is None:
                raise self.unknown(name)
            for n in (spec.name, *(_key(a) for a in spec.aliases)):
                if self._aliases.get(n) == spec.name:
                    del self._aliases[n]
            self._order.pop(name, None)
            self._plugin_owner.pop(name, None)
            self._changed()

    def _changed(self) -> None:
        # What the registry says decides resolutions (the known, platform and
        # supported checks, the supported-set order): a cached resolution made
        # before a change must not outlive it (every memo compares generations).
        self.generation += 1

    def load_plugins(self) -> None:
        if self._plugins_loaded:
            return
        with self._lock:
            # ``_plugins_loaded`` turns true only once every plugin is in, so a
            # lookup on another thread waits on the lock instead of missing a
            # plugin that is still loading; ``_loading`` stops a plugin that
            # parses a backend name while it loads (same thread, re-entrant
            # lock) from starting the load again.
            if self._plugins_loaded or self._loading:
                return
            self._loading = True
            try:
                self._load_entry_points()
            finally:
                self._loading = False
                self._plugins_loaded = True

    def _load_entry_points(self) -> None:
        from importlib import metadata

        try:
            eps = list(metadata.entry_points(group=ENTRY_POINT_GROUP))
        except Exception as exc:  # a broken distribution must not stop start-up
            self._failures.append(PluginFailure("<entry points>", _describe(exc)))
            return
        for ep in sorted(eps, key=lambda e: (e.name, e.value)):
            label = f"{ep.name} = {ep.value}"
            try:
                loaded = ep.load()
                specs = _specs_from_plugin(loaded)
            except BaseException as exc:  # SystemExit in a plugin too
                if isinstance(exc, KeyboardInterrupt):
                    raise
                self._failures.append(PluginFailure(label, _describe(exc)))
                continue
            for spec in specs:
                try:
                    self.add(spec, owner=f"plugin {label}")
                except (PluginError, TypeError, ValueError) as exc:
                    self._failures.append(PluginFailure(label, _describe(exc)))

    # -- lookup -------------------------------------------------------------
    def lookup(self, text: str) -> Backend:
        key = _key(text)
        name = self._aliases.get(key)
        if name is None and not self._plugins_loaded:
            self.load_plugins()
            name = self._aliases.get(key)
        if name is None:
            raise self.unknown(text)
        return Backend(name)

    def unknown(self, text: str) -> UnknownBackendError:
        valid = sorted(self._specs)
        close = difflib.get_close_matches(_key(text), [*valid, *self._aliases], n=1, cutoff=0.5)
        suggestion = self._aliases[close[0]] if close else None
        hint = f" Did you mean {suggestion!r}?" if suggestion else ""
        return UnknownBackendError(
            f"Unknown attention backend {text!r}.{hint} Valid backends: {', '.join(valid)}",
            text,
            suggestion,
        )

    def spec(self, name: str) -> BackendSpec | None:
        return self._specs.get(name)

    def order(self, name: str) -> int:
        return self._order.get(name, max(self._order.values(), default=-1) + 1)

    def specs(self) -> tuple[BackendSpec, ...]:
        self.load_plugins()
        return tuple(sorted(self._specs.values(), key=lambda s: self._order[s.name]))

    def failures(self) -> tuple[PluginFailure, ...]:
        self.load_plugins()
        return tuple(self._failures)

    def reset_plugins(self) -> None:
        """Forget plugin state so entry points load again (tests use this)."""
        with self._lock:
            for name in list(self._plugin_owner):
                if self._plugin_owner[name].startswith("plugin "):
                    self.remove(name)
            self._failures.clear()
            self._plugins_loaded = False


def _describe(exc: BaseException) -> str:
    # escaped, not lone surrogates (a path that is not UTF-8): the text ends up in
    # Platform.notes, hence in every trace, its digest and its UTF-8 file
    text = str(exc).encode("utf-8", "backslashreplace").decode("utf-8")
    return f"{type(exc).__name__}: {text}"


def _specs_from_plugin(obj: Any) -> list[BackendSpec]:
    if callable(obj) and not isinstance(obj, BackendSpec):
        obj = obj()
    if isinstance(obj, BackendSpec):
        return [obj]
    if isinstance(obj, Iterable):
        items = list(obj)
        if all(isinstance(i, BackendSpec) for i in items):
            return items
    raise ArgumentTypeError(
        f"an {ENTRY_POINT_GROUP} entry point must give a BackendSpec, an iterable of them, "
        f"or a callable returning either; got {type(obj).__name__}"
    )


_REGISTRY = _Registry()


def kernels_changed() -> None:
    """A kernel was registered or removed: what a running layer may get changed.

    Called by :mod:`attnres.kernels`; bumps the generation exactly as a backend
    registration does (every memo of the previous generation reads empty).
    """
    with _REGISTRY._lock:
        _REGISTRY._changed()


def registry_generation() -> int:
    """A counter bumped by every registration change."""
    return _REGISTRY.generation


def register_backend(spec: BackendSpec, *, replace: bool = False) -> Backend:
    """Add a backend to the registry; returns its :class:`Backend`."""
    _REGISTRY.load_plugins()
    _REGISTRY.add(spec, replace=replace, owner="register_backend()")
    return Backend(spec.name)


def unregister_backend(backend: Backend | str) -> None:
    """Remove a backend that :func:`register_backend` added."""
    name = backend.name if isinstance(backend, Backend) else backend.strip().lower()
    _REGISTRY.remove(name)


def get_spec(backend: Backend | str) -> BackendSpec:
    """The spec of a registered backend (raises for an unknown one)."""
    b = Backend.parse(backend)
    spec = _REGISTRY.spec(b.name)
    if spec is None:
        raise _REGISTRY.unknown(b.name)
    return spec


def lookup_spec(backend: Backend) -> BackendSpec | None:
    """The spec, or ``None`` when the backend is no longer registered."""
    return _REGISTRY.spec(backend.name)


def catalogue_order(backend: Backend) -> int:
    """Position in the catalogue: the deterministic order of supported-set candidates."""
    return _REGISTRY.order(backend.name)


def registered_backends() -> tuple[BackendSpec, ...]:
    """Every registered spec, built-ins first, in registration order."""
    return _REGISTRY.specs()


def plugin_failures() -> tuple[PluginFailure, ...]:
    """Plugins from the ``attnres.backends`` group that failed to load, with why."""
    return _REGISTRY.failures()


def reload_plugins() -> tuple[PluginFailure, ...]:
    """Drop plugin-registered backends and load the entry points again."""
    _REGISTRY.reset_plugins()
    return plugin_failures()


def normalize_backend_options(value: object) -> BackendOptions:
    """``{backend: {option: value}}`` checked against the specs, as sorted plain data.

    (issue 23) A backend name goes through :meth:`Backend.parse` (aliases,
    did-you-mean); an option its spec does not declare, or a value the option
    does not take, is a :class:`~attnres.errors.BackendOptionError` naming the
    closest declared option. ``None`` and ``{}`` are no options.
    """
    if value is None or value == ():
        return ()
    if isinstance(value, tuple):  # the normalised form (attrs.evolve passes it back)
        with contextlib.suppress(TypeError, ValueError):  # else reported below
            value = {backend: dict(pairs) for backend, pairs in value}
    if not isinstance(value, Mapping):
        raise BackendOptionError(
            f"backend_options: expected a mapping {{backend: {{option: value}}}}, got {value!r}",
            "",
            "",
        )
    out: dict[str, tuple[tuple[str, OptionValue], ...]] = {}
    for raw_backend, given in value.items():
        spec = get_spec(Backend.parse(raw_backend))
        if not isinstance(given, Mapping):
            raise BackendOptionError(
                f"backend_options: {spec.name!r} takes a mapping {{option: value}}, got {given!r}",
                spec.name,
                "",
            )
        declared = {o.name: o for o in spec.options}
        checked: dict[str, OptionValue] = {}
        for name, item in given.items():
            option = declared.get(name) if isinstance(name, str) else None
            if option is None:
                close = difflib.get_close_matches(str(name), list(declared), n=1, cutoff=0.6)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                takes = ", ".join(sorted(declared)) or "none"
                raise BackendOptionError(
                    f"backend_options: backend {spec.name!r} has no option {name!r}{hint}; "
                    f"its options: {takes} (docs/backends.md)",
                    spec.name,
                    str(name),
                    close[0] if close else None,
                )
            checked[name] = option.check(spec.name, item)
        if checked:
            out[spec.name] = tuple(sorted(checked.items()))
    return tuple(sorted(out.items()))


def entry_point_options(
    backend: str,
    options: Iterable[tuple[str, OptionValue]],
    capability: tuple[int, int] | None,
    *,
    varlen: bool = False,
    where: str = "",
) -> EntryPoint | None:
    """The function ``backend`` runs on a device of ``capability`` with ``options``,
    after checking that it takes each of them (issue 23).

    ``None`` where the backend has no per-GPU functions (its kernel takes its
    options itself), no options are given, or the capability is not known yet
    (the kernel adapter checks again on the tensors' device). ``varlen``: the
    varlen entry point (the unpad route). An option the function does not take,
    or a value it does not take there, is a
    :class:`~attnres.errors.BackendOptionError` naming the option, the GPU, the
    function and what to do; ``where`` says whose options they are.
    """
    given = tuple(options)
    spec = _REGISTRY.spec(Backend.parse(backend).name) if given else None
    if spec is None or not spec.entry_points or (capability is None and not varlen):
        return None
    entry = next((e for e in spec.entry_points if e.serves(capability, varlen)), None)
    if entry is None:
        raise BackendOptionError(
            f"backend_options{where}: {spec.name} has no function for {_sm(capability)}, so its "
            f"options ({', '.join(n for n, _ in given)}) cannot be passed (docs/backends.md)",
            spec.name,
            given[0][0],
        )
    on = "on every GPU" if varlen else f"on {_sm(capability)}"
    for name, value in given:
        option = entry.option(name)
        if option is None:
            takes = ", ".join(o.name for o in entry.options) or "none"
            todo = (
                f"Drop {name} for this layer (its key-padding masks run through {entry.name})"
                if varlen
                else f"Drop {name} for this platform, or give it only to layers of a platform "
                f"whose function takes it"
            )
            raise BackendOptionError(
                f"backend_options{where}: {spec.name}.{name} is not taken by {entry.name}, the "
                f"function {spec.name} runs {on} ({entry.source}); it takes: {takes}. {todo} "
                f"(docs/backends.md#per-backend-options)",
                spec.name,
                name,
            )
        if option.takes(value):
            continue
        raise BackendOptionError(
            f"backend_options{where}: {spec.name}.{name}={value!r} is not taken by "
            f"{entry.name}, the function {spec.name} runs {on}; expected {option.describe()} "
            f"(from {option.source})",
            spec.name,
            name,
        )
    return entry


def merge_backend_options(base: BackendOptions, over: BackendOptions) -> BackendOptions:
    """``over``'s options on top of ``base``'s, option by option (both normalised)."""
    if not base or not over:
        return over or base
    merged = {backend: dict(pairs) for backend, pairs in base}
    for backend, pairs in over:
        merged.setdefault(backend, {}).update(pairs)
    return tuple(sorted((b, tuple(sorted(p.items()))) for b, p in merged.items()))


_TEXT_VALUES: dict[str, OptionValue] = {"true": True, "false": False, "none": None}
_NUMBERS: dict[str, type[int] | type[float]] = {"int": int, "float": float}


def parse_backend_option(text: str) -> tuple[str, str, OptionValue]:
    """``"BACKEND.OPTION=VALUE"`` (the CLI's ``--backend-option``) as typed data.

    The value is read as the declared option's kind (``true``/``false`` for a
    bool, an integer for an int, ``none`` where the option takes ``None``) and
    then checked like any other (:func:`normalize_backend_options`).
    """
    key, sep, raw = (part.strip() for part in text.partition("="))
    backend_name, dot, name = key.partition(".")
    if not sep or not dot or not backend_name or not name:
        raise BackendOptionError(
            f"backend option: expected BACKEND.OPTION=VALUE (fa.deterministic=true), got {text!r}",
            backend_name,
            name,
        )
    spec = get_spec(Backend.parse(backend_name))
    option = next((o for o in spec.options if o.name == name), None)
    value: object = raw
    if option is not None and raw.lower() in _TEXT_VALUES and option.kind == "bool":
        value = _TEXT_VALUES[raw.lower()]
    elif option is not None and raw.lower() == "none" and option.nullable:
        value = None
    elif option is not None and option.kind in _NUMBERS:
        with contextlib.suppress(ValueError):
            value = _NUMBERS[option.kind](raw)
    checked = normalize_backend_options({spec.name: {name: value}})
    return spec.name, name, checked[0][1][0][1]
