"""Hypothesis strategies over attnres's whole input space, shared by the tests.

Imported as ``import strategies`` from test modules in ``tests/`` (pytest's
default ``prepend`` import mode puts ``tests/`` on ``sys.path``).

The strategies reach further than the small ones inside ``test_machine.py`` and
``test_trace.py``:

- platforms of every kind, built directly (any compute capability, any ROCm
  architecture, any torch version string, every package present, missing,
  broken -- with an import error's text -- or not probed at all, notes) or
  from the simulation grammar;
- layers with odd and huge head sizes, every dtype and its aliases (and torch
  dtypes), backend names in any case and by alias, every requirement;
- selection configs with explicit, implicit and forced backends and
  per-component backends;
- scope snapshots (:class:`~attnres.scope.ScopeState`) of every registered
  kind, with component and role overrides, and the ``component_scope(...)``
  arguments that produce them.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
from hypothesis import strategies as st

from attnres import LayerSpec, Platform, Requirements, Role, SelectionConfig
from attnres._vocab import _DTYPE_ALIASES, DTYPES, PLATFORM_KINDS
from attnres.backends import BUILTIN_SPECS, Backend
from attnres.layer import MAX_HEAD_SIZE
from attnres.platform import KNOWN_PACKAGES, PackageFact
from attnres.scope import _LOADERS as _REGISTERED_LOADERS
from attnres.scope import ScopeState, loader_for
from attnres.trace import TraceInput

__all__ = [
    "BACKEND_NAMES",
    "DENSE_NAMES",
    "SPARSE_NAMES",
    "backend_names",
    "backend_spellings",
    "configs",
    "head_sizes",
    "inputs",
    "layers",
    "maybe_backend",
    "package_facts",
    "platforms",
    "requirements",
    "scope_args",
    "scope_state_from_args",
    "scope_states",
]

#: Any text, including the lone surrogates of a non-UTF-8 path decoded with
#: ``surrogateescape`` (U+DC80..U+DCFF, the undecodable bytes 0x80..0xff). (A
#: high surrogate followed by a low one cannot survive JSON: its escapes load
#: back as one astral character. ``surrogateescape`` never makes high ones.)
any_text = st.one_of(
    st.text(max_size=30),
    st.builds(
        "{}{}{}".format,  # "site-packages-\xff" decoded: "site-packages-\udcff"
        st.text(max_size=10),
        st.text(st.characters(min_codepoint=0xDC80, max_codepoint=0xDCFF), min_size=1, max_size=3),
        st.text(max_size=10),
    ),
)

#: Every built-in backend, by canonical name.
BACKEND_NAMES: tuple[str, ...] = tuple(s.name for s in BUILTIN_SPECS)
SPARSE_NAMES: tuple[str, ...] = tuple(s.name for s in BUILTIN_SPECS if s.sparse)
DENSE_NAMES: tuple[str, ...] = tuple(s.name for s in BUILTIN_SPECS if not s.sparse)
_ALIASES: tuple[str, ...] = tuple(a for s in BUILTIN_SPECS for a in s.aliases)
PACKAGE_NAMES: tuple[str, ...] = tuple(p.name for p in KNOWN_PACKAGES)

backend_names = st.sampled_from(BACKEND_NAMES)


@st.composite
def backend_spellings(draw: st.DrawFn) -> Backend | str:
    """A built-in backend as users may give it: a ``Backend``, its name in any case, an alias."""
    how = draw(st.sampled_from(["backend", "name", "upper", "alias"]))
    if how == "alias":
        return draw(st.sampled_from(_ALIASES)).replace("_", draw(st.sampled_from(["_", "-"])))
    name = draw(backend_names)
    if how == "backend":
        return Backend(name)
    return name.upper() if how == "upper" else name


def maybe_backend(p_none: int = 1) -> st.SearchStrategy[Backend | str | None]:
    """``None`` (weighted ``p_none`` to 1) or a spelling of a built-in backend."""
    return st.one_of(*([st.none()] * p_none), backend_spellings())


# -- platforms -------------------------------------------------------------------

_BROKEN_DETAILS = (
    "import failed: ImportError: libcuda.so.1: cannot open shared object file",
    "import failed: OSError: /x/_C.so: undefined symbol: _ZN3c1017SymbolicShapeMeta",
    "import failed: RuntimeError: HIP error: no ROCm-capable device is detected",
    "import failed: SystemExit: 3",
    "import failed: ValueError",
)


@st.composite
def package_facts(draw: st.DrawFn, name: str) -> PackageFact | None:
    """One package's fact, or ``None`` (not probed on this platform)."""
    status = draw(st.sampled_from(["present", "present", "missing", "broken", "unprobed"]))
    if status == "unprobed":
        return None
    if status == "present":
        version = draw(st.one_of(st.none(), st.sampled_from(["2.7.4", "simulated", "0.0.dev0"])))
        return PackageFact(name, "present", version, None)
    if status == "missing":
        detail = draw(
            st.sampled_from(
                [None, "not installed", "module 'flash_attn' belongs to flash-attn-4 1.0"]
            )
        )
        return PackageFact(name, "missing", None, detail)
    detail = draw(st.one_of(st.sampled_from(_BROKEN_DETAILS), any_text))
    return PackageFact(name, "broken", None, detail)


_CAPABILITIES = [(5, 0), (7, 0), (7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0), (12, 1)]
_ROCM_ARCHS = ["gfx90a", "gfx942", "gfx950", "gfx1100"]


@st.composite
def _built_platforms(draw: st.DrawFn) -> Platform:
    kind = draw(st.sampled_from(PLATFORM_KINDS))
    capability: tuple[int, int] | None = None
    arch: str | None = None
    if kind == "cuda":
        capability = draw(
            st.one_of(
                st.none(),
                st.sampled_from(_CAPABILITIES),
                st.tuples(st.integers(0, 15), st.integers(0, 9)),
            )
        )
        arch = None if capability is None else f"sm{capability[0]}{capability[1]}"
    elif kind == "rocm":
        arch = draw(st.one_of(st.none(), st.sampled_from(_ROCM_ARCHS)))
    elif draw(st.integers(0, 9)) == 0:  # facts a real probe would not give: still handled
        capability = draw(st.sampled_from(_CAPABILITIES))
        arch = draw(st.sampled_from(["sm90", "gfx942", "ascend910b"]))
    facts = [draw(package_facts(name)) for name in PACKAGE_NAMES]
    return Platform(
        kind=kind,
        device_name=draw(st.sampled_from(["", "NVIDIA H100 80GB HBM3", "AMD Instinct MI300X"])),
        capability=capability,
        arch=arch,
        torch_version=draw(
            st.sampled_from([None, "2.13.0", "2.4.1", "2.5.0", "2.6.0a0", "nightly"])
        ),
        packages=tuple(f for f in facts if f is not None),
        notes=tuple(draw(st.lists(st.sampled_from(["torch.cuda query failed: X"]), max_size=1))),
        simulated=draw(st.booleans()),
    )


@st.composite
def _simulated_platforms(draw: st.DrawFn) -> Platform:
    kind = draw(st.sampled_from(PLATFORM_KINDS))
    text = kind
    if kind == "cuda" and draw(st.booleans()):
        major, minor = draw(st.sampled_from(_CAPABILITIES))
        text += f":sm{major}{minor}"
    elif kind == "rocm" and draw(st.booleans()):
        text += ":" + draw(st.sampled_from(_ROCM_ARCHS))
    packages = draw(st.lists(st.sampled_from([*PACKAGE_NAMES, "all"]), max_size=4))
    return Platform.simulate(text + "".join("+" + p for p in packages))


platforms = st.one_of(_built_platforms(), _simulated_platforms())


# -- layers ----------------------------------------------------------------------

head_sizes = st.one_of(
    st.sampled_from([1, 8, 16, 32, 36, 40, 64, 72, 80, 96, 112, 128, 160, 192, 256, 512]),
    st.integers(1, 1100),  # odd sizes, past every kernel's limit
    # large, up to the bound (past it is an error: the bad-input catalogue)
    st.integers(1101, MAX_HEAD_SIZE),
)

_TORCH_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
dtypes = st.one_of(
    st.sampled_from(DTYPES),
    st.sampled_from(sorted(_DTYPE_ALIASES)),
    st.sampled_from(_TORCH_DTYPES),
)

requirements = st.builds(
    Requirements,
    causal=st.booleans(),
    attn_mask=st.booleans(),
    packed_varlen=st.booleans(),
    gqa=st.booleans(),
    dropout=st.booleans(),
)


@st.composite
def layers(draw: st.DrawFn) -> LayerSpec:
    supported = draw(st.one_of(st.none(), st.lists(backend_spellings(), min_size=1, max_size=5)))
    return LayerSpec(
        head_size=draw(head_sizes),
        dtype=draw(dtypes),
        supported=supported,
        default=draw(maybe_backend()),
        role=draw(st.sampled_from([Role.SELF, Role.CROSS, "self", "CROSS"])),
        requirements=draw(requirements),
        name=draw(
            st.one_of(st.none(), st.sampled_from(["blocks.0.attn1", "attn2", "ünï.attn"]), any_text)
        ),
    )


# -- configs ---------------------------------------------------------------------

COMPONENT_NAMES = (
    "transformer",
    "transformer_2",
    "dit",
    "text_encoder",
    "text_encoder_2",
    "t5_text_encoder",
    "image_encoder",
    "vae",
    "audio_vae",
    "vocoder",
    "connectors",
    "bridge",
    "motion_prior",  # unknown: generic, strict
)

#: Any component name a user may type (non-empty once stripped).
component_names = st.one_of(
    st.sampled_from(COMPONENT_NAMES),
    any_text.filter(lambda s: bool(s.strip())),
)


@st.composite
def configs(draw: st.DrawFn) -> SelectionConfig:
    components = draw(st.dictionaries(component_names, backend_spellings(), max_size=2))
    return SelectionConfig(
        global_backend=draw(maybe_backend()),
        global_backend_explicit=draw(st.booleans()),
        forced_backend=draw(maybe_backend(3)),
        component_backends=components,
    )


# -- scopes ----------------------------------------------------------------------


@st.composite
def scope_args(draw: st.DrawFn) -> dict[str, Any]:
    """Keyword arguments of ``component_scope`` (``name`` included)."""
    args: dict[str, Any] = {"name": draw(component_names)}
    if draw(st.booleans()):
        args["kind"] = draw(st.sampled_from(sorted(_REGISTERED_LOADERS)))
    args["backend"] = draw(maybe_backend(2))
    roles = draw(
        st.dictionaries(
            st.sampled_from([Role.SELF, Role.CROSS, "self", "cross"]),
            backend_spellings(),
            max_size=2,
        )
    )
    # "self" and Role.SELF are one role: keep one of them
    by_role: dict[Role, Any] = {Role.parse(r): b for r, b in roles.items()}
    args["role_backends"] = {r.value: b for r, b in by_role.items()} or None
    args["allow_global_fallback"] = draw(st.sampled_from([None, True, False]))
    args["require_selection"] = False
    return args


def scope_state_from_args(args: dict[str, Any]) -> ScopeState:
    """The snapshot ``component_scope(**args)`` publishes (built without entering it)."""
    from attnres._vocab import normalize_component
    from attnres.scope import _role_backends, component_kind

    kind = args.get("kind") or component_kind(args["name"])
    loader = loader_for(kind)
    backend = args.get("backend")
    allow = args.get("allow_global_fallback")
    roles = _role_backends(args.get("role_backends"))
    return ScopeState(
        component=normalize_component(args["name"]),  # "Text-Encoder" -> "text_encoder"
        kind=kind,
        loader=loader.__name__,
        backend=None if backend is None else Backend.parse(backend),
        role_backends=roles,
        allow_global_fallback=loader.allow_global_fallback if allow is None else bool(allow),
        require_selection=bool(args.get("require_selection")),
    )


scope_states = st.one_of(st.none(), scope_args().map(scope_state_from_args))


@st.composite
def inputs(draw: st.DrawFn) -> TraceInput:
    """A full resolution input: layer, config, scope snapshot, platform, layer backend."""
    backend = draw(maybe_backend(4))
    return TraceInput(
        layer=draw(layers()),
        config=draw(configs()),
        scope=draw(scope_states),
        platform=draw(platforms),
        backend=backend,
    )


def with_forced(inp: TraceInput, backend: Backend | str) -> TraceInput:
    return attrs.evolve(inp, config=attrs.evolve(inp.config, forced_backend=backend))
