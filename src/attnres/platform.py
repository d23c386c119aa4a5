"""Platform facts: what device this is and which kernel packages work here.

:meth:`Platform.detect` probes the real machine once per process. A probe never
raises: an import that fails with ``ImportError``, ``OSError`` ("undefined
symbol" after a torch upgrade), ``RuntimeError``, ``SystemExit`` or anything
else becomes a recorded :class:`PackageFact` with the exception's type and
message, and a ``torch.cuda`` that raises on query becomes a note.

:meth:`Platform.simulate` builds hermetic facts from the grammar
``KIND[:ARCH][+PACKAGE...]`` (``cuda:sm90+flash_attn+sageattention``,
``rocm:gfx942+aiter``, ``npu+torch_npu``, ``cuda:sm100+all``), so a trace
recorded on a GPU replays on a laptop.

The per-kind default preference chain (SPEC 3.4, stage ``platform_default``)
lives here too: :meth:`Platform.default_chain`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.machinery
import importlib.metadata as metadata
import importlib.util
import io
import os
import re
import sys
import tempfile
import threading
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Final

import attrs
from attrs import field, frozen

from attnres._states import PackageStatus
from attnres._vocab import PLATFORM_KINDS, release
from attnres.backends import (
    Backend,
    BackendSpec,
    CapabilityRule,
    KernelFacts,
    installed_facts,
    plugin_failures,
    registered_backends,
    registry_generation,
)
from attnres.errors import InvalidArgumentError

__all__ = [
    "CUDA_CHAINS",
    "DEFAULT_CHAINS",
    "GRAMMAR",
    "KNOWN_PACKAGES",
    "ROCM_CHAINS",
    "ChainRule",
    "PackageFact",
    "PackageProbe",
    "Platform",
    "detected_platform",
]

#: The simulation grammar, as shown in every parse error.
GRAMMAR = (
    "KIND[:ARCH][+PACKAGE...] where KIND is one of "
    + ", ".join(PLATFORM_KINDS)
    + "; ARCH is a CUDA compute capability (sm80, sm90, sm100, 9.0) or a device "
    "architecture (gfx942 on rocm); each +PACKAGE marks an optional kernel package "
    "present, +all marks every one; +PACKAGE==VERSION also gives its installed version "
    "(+PACKAGE==DISTRIBUTION@VERSION: the distribution it belongs to). Examples: cpu, "
    "cuda:sm90+flash_attn+sageattention, cuda:sm89+sageattention==1.0.6, "
    "cuda:sm90+flash_attn_4==flash-attn@2.8.3, rocm:gfx942+aiter, npu+torch_npu"
)

#: The platform kinds whose ``KIND:ARCH`` names an architecture.
_KINDS_WITH_ARCH = ("cuda", "rocm")

#: The torch version recorded in simulated platforms (hermetic on purpose).
SIMULATED_TORCH_VERSION = "2.13.0"


@frozen
class PackageProbe:
    """How to find one optional kernel package: its import and its distributions."""

    name: str
    module: str
    distributions: tuple[str, ...]
    aliases: tuple[str, ...] = ()
    #: a distribution that also installs ``module`` but is *not* this package
    impostors: tuple[str, ...] = ()
    #: issue 31: a distribution that ships ``module`` inside itself as an older,
    #: different kernel (flash-attn 2.8's early ``flash_attn.cute``): recorded as
    #: that distribution and its version, so the catalogue's version-keyed facts
    #: (``BackendSpec.variants``) tell the two apart
    hosts: tuple[str, ...] = ()


#: Every optional kernel package the built-in catalogue needs.
KNOWN_PACKAGES: tuple[PackageProbe, ...] = (
    PackageProbe("aiter", "aiter", ("amd-aiter", "aiter"), ("amd-aiter", "amd_aiter")),
    PackageProbe(
        "flash_attn",
        "flash_attn",
        ("flash-attn", "flash_attn"),
        ("flash-attn", "flash_attn_2", "flash-attn-2"),
        impostors=("flash-attn-4",),
    ),
    PackageProbe(
        "flash_attn_4",
        "flash_attn.cute",
        ("flash-attn-4", "flash_attn_4"),
        ("flash-attn-4", "flash_attn.cute", "fa4"),
        hosts=("flash-attn", "flash_attn"),
    ),
    PackageProbe(
        "flash_attn_interface",
        "flash_attn_interface",
        ("flash-attn-3", "flash_attn_3"),
        ("flash_attn_3", "flash-attn-3", "fa3"),
    ),
    # FastVideo's kernels: one package since FastVideo #962 (2025-12); the older
    # separate modules (st_attn, vsa, vmoba) still serve old installs
    PackageProbe(
        "fastvideo_kernel",
        "fastvideo_kernel",
        ("fastvideo-kernel", "fastvideo_kernel"),
        ("fastvideo-kernel", "fastvideo"),
    ),
    PackageProbe("sageattention", "sageattention", ("sageattention",), ("sage",)),
    PackageProbe("sageattn3", "sageattn3", ("sageattn3",), ("sageattention3",)),
    PackageProbe("st_attn", "st_attn", ("st_attn", "st-attn")),
    PackageProbe("svg", "svg", ("svg", "sparse-videogen")),
    PackageProbe("torch_npu", "torch_npu", ("torch-npu", "torch_npu")),
    PackageProbe("vmoba", "vmoba", ("vmoba",)),
    PackageProbe("vsa", "vsa", ("vsa",)),
    PackageProbe("xformers", "xformers", ("xformers",)),
)

#: The platform_default stage (SPEC 3.4), per device kind: preferred first, each
#: entry but the last only where usable here (rendered in docs/state-machine.md).
DEFAULT_CHAINS: Final[Mapping[str, tuple[str, ...]]] = {
    "cuda": ("fa", "torch_sdpa"),
    "rocm": ("aiter", "torch_sdpa"),
    "npu": ("ascend_fa", "torch_sdpa"),
    "cpu": ("torch_sdpa",),
    "mps": ("torch_sdpa",),
    "xpu": ("torch_sdpa",),
}


@frozen
class ChainRule:
    """Issue 31: the CUDA chain on the GPUs ``capabilities`` admits, and why."""

    capabilities: CapabilityRule
    chain: tuple[str, ...]
    source: str


#: Issue 31: the platform_default chain per CUDA generation, read from what the
#: kernels' own code accepts (docs/backends.md#platform-default-chains). The first
#: rule that admits the device's capability gives its chain; an unknown capability
#: or one no rule admits keeps ``DEFAULT_CHAINS["cuda"]``.
CUDA_CHAINS: Final[tuple[ChainRule, ...]] = (
    ChainRule(
        CapabilityRule(min=(8, 0), max=(8, 9)),
        ("fa", "torch_sdpa"),
        "flash-attn 2 (flash_api.cpp: 'FlashAttention only supports Ampere GPUs or newer') "
        "is built for sm80 and sm90 by every wheel (setup.py cuda_archs)",
    ),
    ChainRule(
        CapabilityRule(exact={(9, 0)}),
        ("fa3", "fa", "torch_sdpa"),
        "FlashAttention-3 is the Hopper kernel (flash-attn 2.8.3 README: 'FlashAttention-3 is "
        "optimized for Hopper GPUs (e.g. H100)'); vLLM takes it first there "
        "(vllm/attention/utils/fa_utils.py 0fa99d44, get_flash_attn_version: 'fa_version = 3 "
        "if (device_capability.major == 9 and is_fa_version_supported(3)) else 2'); "
        "flash-attn 2 (built for sm90 by every wheel) where FA3 is not installed",
    ),
    ChainRule(
        CapabilityRule(min=(10, 0), max=(11, 0)),
        ("fa4", "torch_sdpa"),
        "flash-attn 2.8.3 setup.py builds sm100 only with CUDA >= 12.8, so a wheel built "
        "without it imports and dies at the first call ('no kernel image'); FA3 is sm90 "
        "only; FlashAttention-4 (flash-attn-4 4.0.0b36 flash_attn/cute/interface.py) is "
        "tuned for sm100/sm110 and checks the device itself",
    ),
    ChainRule(
        CapabilityRule(min=(12, 0), max=(12, 1)),
        ("torch_sdpa",),
        "flash-attn 2.8.3 setup.py builds sm120 only with CUDA >= 12.8 (a wheel without it "
        "dies at the first call); FlashAttention-4 runs sm120 on sm80 MMA with no "
        "deterministic backward and no split-KV; torch SDPA dispatches flash/cuDNN/"
        "efficient per call itself (sdp_utils.cpp), as SGLang, vLLM and xDiT choose SDPA "
        "or cuDNN on sm12x",
    ),
)


#: Issue 31: the platform_default chain per ROCm architecture (the first rule whose
#: ``archs`` names the device's; another or an unknown one keeps
#: ``DEFAULT_CHAINS["rocm"]``).
ROCM_CHAINS: Final[tuple[ChainRule, ...]] = (
    ChainRule(
        CapabilityRule(archs={"gfx942", "gfx950"}),
        ("aiter", "torch_sdpa"),
        "aiter's README and aiter/ops/mha.py build its flash attention for gfx942 and "
        "gfx950 (ROCm/aiter e4048607)",
    ),
    ChainRule(
        CapabilityRule(archs={"gfx90a"}),
        ("fa", "torch_sdpa"),
        "aiter has no gfx90a build; flash-attn 2's ROCm CK backend (csrc/flash_attn_ck) "
        "supports gfx90a, gfx942 and gfx950 (flash-attention README)",
    ),
)


@functools.lru_cache(maxsize=64)
def _backends(names: tuple[str, ...]) -> tuple[Backend, ...]:
    """A chain's names as backends (a pure function of the names, memoised)."""
    return tuple(Backend(n) for n in names)


@frozen
class PackageFact:
    """One optional kernel package: present with a version, or absent with why."""

    name: str
    status: PackageStatus = field(converter=PackageStatus)
    version: str | None = None
    detail: str | None = None
    #: issue 31: the distribution ``version`` belongs to (``sageattention``,
    #: ``flash-attn-4``; ``flash-attn`` for its early ``flash_attn.cute``), which
    #: keys the catalogue's version facts; written only when known
    distribution: str | None = field(default=None, metadata={"omit_default": True})

    @property
    def usable(self) -> bool:
        return self.status == PackageStatus.PRESENT

    def describe(self) -> str:
        if self.status == PackageStatus.PRESENT:
            version = self.version or "unknown version"
            return f"{self.distribution} {version}" if self.distribution else version
        return f"{self.status}: {self.detail}" if self.detail else self.status


def _package_probes() -> tuple[PackageProbe, ...]:
    known = {p.name: p for p in KNOWN_PACKAGES}
    for spec in registered_backends():
        for package in spec.packages:
            if package not in known:
                known[package] = PackageProbe(package, package, (package,))
    return tuple(sorted(known.values(), key=lambda p: p.name))


def _package_alias_map() -> dict[str, str]:
    out: dict[str, str] = {}
    for p in _package_probes():
        for n in (p.name, p.module, *p.aliases):
            out[n.lower()] = p.name
    return out


def _simulated_fact(probe: PackageProbe, pinned: tuple[str | None, str] | None) -> PackageFact:
    """A present package in a simulated platform: version ``simulated`` (the
    catalogue's own facts apply), or the pinned ``(distribution, version)``
    (the package's first distribution when none is named)."""
    if pinned is None:
        return PackageFact(probe.name, "present", "simulated", None)
    dist, version = pinned
    return PackageFact(probe.name, "present", version, None, dist or probe.distributions[0])


def _parse_capability(arch: str) -> tuple[int, int] | None:
    # at most 3 digits of major version and one of minor (sm120 is 12.0): bounded
    # here, so every capability a trace holds reads back (issue 32 item 15)
    m = re.fullmatch(r"(?:sm_?|compute_)?(\d{2,4})([a-z]?)", arch.lower())
    if m:
        digits = m.group(1)
        return int(digits[:-1]), int(digits[-1])
    m = re.fullmatch(r"(\d{1,3})\.(\d)", arch)
    if m:
        return int(m.group(1)), int(m.group(2))
    return None


def _facts(value: Iterable[PackageFact]) -> tuple[PackageFact, ...]:
    return tuple(value)


def _notes(value: Iterable[str]) -> tuple[str, ...]:
    return tuple(value)


@frozen
class HostResolution:
    """What a host framework's platform resolves one candidate to (issue 23).

    Observed, not enumerated: the SGLang plugin asks SGLang's own platform
    (``_cached_get_attn_backend``) for every candidate the ``sglang`` profile
    may evaluate and records the answer here, so a trace holds every platform
    fact its decision read and replays without SGLang. ``candidate`` is the
    backend asked for (``""``: the platform's own default); ``served`` the
    backend whose class it returned (``None`` with ``error`` when it refused);
    ``sparse`` (the candidate's), ``served_sparse`` and ``missing`` (the layer's
    requirements the served class does not implement) are read from SGLang's
    enum and classes.
    """

    candidate: str
    served: str | None = None
    error: str | None = None
    #: the candidate is a sparse backend (SGLang's ``AttentionBackendEnum.is_sparse``)
    sparse: bool = False
    #: the served backend is sparse
    served_sparse: bool = False
    missing: tuple[str, ...] = ()


def _host(value: Iterable[HostResolution]) -> tuple[HostResolution, ...]:
    return tuple(value)


@frozen(cache_hash=True)
class Platform:
    """Frozen, serialisable facts about a device and its kernel packages."""

    kind: str = field()
    device_name: str = ""
    capability: tuple[int, int] | None = None
    arch: str | None = None
    torch_version: str | None = None
    packages: tuple[PackageFact, ...] = field(default=(), converter=_facts)
    notes: tuple[str, ...] = field(default=(), converter=_notes)
    simulated: bool = False
    #: issue 23: a host framework's observed platform resolutions (the
    #: ``sglang`` profile's platform facts); written only when present
    host: tuple[HostResolution, ...] = field(
        default=(), converter=_host, metadata={"omit_default": True}
    )

    def host_resolution(self, candidate: str) -> HostResolution | None:
        """The observed host resolution of ``candidate`` ("": the platform default)."""
        for fact in self.host:
            if fact.candidate == candidate:
                return fact
        return None

    @kind.validator
    def _check_kind(self, _: Any, value: str) -> None:
        if value not in PLATFORM_KINDS:
            raise InvalidArgumentError(
                f"platform kind must be one of {', '.join(PLATFORM_KINDS)}, got {value!r}"
            )

    # -- queries ------------------------------------------------------------
    def package(self, name: str) -> PackageFact:
        for fact in self.packages:
            if fact.name == name:
                return fact
        return PackageFact(name, "missing", None, "not probed on this platform")

    def default_chain(self) -> tuple[Backend, ...]:
        """The platform's preference chain (stage ``platform_default``).

        Every entry but the last is preferred only where it is usable for the
        layer (its package present, the device, dtype and head size fit): the
        machine passes over an unusable one with a recorded reason, and does not
        count that as a fallback. The last entry is the unconditional default.
        """
        if self.kind == "cuda" and self.capability is not None:
            for rule in CUDA_CHAINS:
                if rule.capabilities.fits(self.capability):
                    return _backends(rule.chain)
        if self.kind == "rocm" and self.arch is not None:
            for rule in ROCM_CHAINS:
                if rule.capabilities.archs is not None and self.arch in rule.capabilities.archs:
                    return _backends(rule.chain)
        return _backends(DEFAULT_CHAINS[self.kind])

    def installed(self, spec: BackendSpec) -> tuple[BackendSpec, tuple[KernelFacts, ...]]:
        """``spec`` as the kernel installed here is (issue 31): its
        :class:`~attnres.backends.KernelFacts` entries that match this
        platform's distribution, version and device applied, and those entries."""
        if not spec.variants:
            return spec, ()
        return installed_facts(spec, *self.distribution(spec), self.kind, self.capability)

    def distribution(self, spec: BackendSpec) -> tuple[str | None, str | None]:
        """The installed distribution of ``spec``'s package and its version (``None``s:
        no package, or not probed), which a spec's version-keyed facts read."""
        if spec.package is None:
            return None, None
        fact = self.package(spec.package)
        return fact.distribution, fact.version

    def torch_at_least(self, version: tuple[int, int]) -> bool | None:
        numbers = release(self.torch_version or "")
        return None if len(numbers) < 2 else numbers[:2] >= version

    def device(self) -> str:
        """The device in words: kind, then capability or arch, then (detected
        only) the device's name when it says more, e.g. ``cuda sm90 (NVIDIA H100)``."""
        where = self.kind
        if self.capability is not None:
            where += f" sm{self.capability[0]}{self.capability[1]}"
        elif self.arch:
            where += f" {self.arch}"
        if not self.simulated and self.device_name and self.device_name != self.kind:
            where += f" ({self.device_name})"
        return where

    def describe(self) -> str:
        """:meth:`device`, marked ``(simulated)`` for simulated facts."""
        return self.device() + " (simulated)" if self.simulated else self.device()

    # -- construction -------------------------------------------------------
    @classmethod
    def simulate(cls, text: str) -> Platform:
        """Hermetic facts from ``KIND[:ARCH][+PACKAGE...]``; see :data:`GRAMMAR`."""
        if not isinstance(text, str):
            raise InvalidArgumentError(f"platform spec must be a string in the form {GRAMMAR}")
        raw = text.strip()
        m = re.fullmatch(
            r"(?P<kind>[A-Za-z]+)(?::(?P<arch>[A-Za-z0-9_.]+))?"
            r"(?P<pkgs>(?:\+[A-Za-z0-9_.\-]+(?:==[A-Za-z0-9_.\-@!]+)?)*)",
            raw,
        )
        if not m:
            raise InvalidArgumentError(f"cannot parse platform spec {text!r}; expected {GRAMMAR}")
        kind = m.group("kind").lower()
        if kind not in PLATFORM_KINDS:
            raise InvalidArgumentError(
                f"unknown platform kind {m.group('kind')!r} in {text!r}; expected {GRAMMAR}"
            )
        arch = m.group("arch")
        capability: tuple[int, int] | None = None
        if arch is not None:
            arch = arch.lower()
            if kind == "cuda":
                capability = _parse_capability(arch)
                if capability is None:
                    raise InvalidArgumentError(
                        f"cannot parse CUDA architecture {m.group('arch')!r} in {text!r} "
                        f"(use sm80, sm90, sm100, sm120 or 9.0); expected {GRAMMAR}"
                    )
                arch = f"sm{capability[0]}{capability[1]}"
            elif kind == "rocm" and not re.fullmatch(r"gfx[0-9a-f]+", arch):
                raise InvalidArgumentError(
                    f"cannot parse ROCm architecture {m.group('arch')!r} in {text!r} "
                    f"(use gfx90a, gfx942, gfx950); expected {GRAMMAR}"
                )
            elif kind not in _KINDS_WITH_ARCH:
                # cpu, mps, xpu and npu have no architecture attnres could check
                # against: "cpu:sm90" is a typo of "cuda:sm90", never a CPU
                if _parse_capability(arch) is not None:
                    meant = f"; did you mean 'cuda:{arch}'?"
                elif re.fullmatch(r"gfx[0-9a-f]+", arch):
                    meant = f"; did you mean 'rocm:{arch}'?"
                else:
                    meant = ""
                raise InvalidArgumentError(
                    f"platform kind {kind!r} takes no architecture, got {m.group('arch')!r} in "
                    f"{text!r}{meant} (only cuda and rocm take one); expected {GRAMMAR}"
                )
        aliases = _package_alias_map()
        present: set[str] = set()
        versions: dict[str, tuple[str | None, str]] = {}
        for item in filter(None, m.group("pkgs").split("+")):
            token, _, pinned = item.partition("==")
            low = token.lower()
            if pinned and low == "all":
                raise InvalidArgumentError(
                    f"+all takes no version in platform spec {text!r}; expected {GRAMMAR}"
                )
            if low == "all":
                present.update(aliases.values())
                continue
            if low not in aliases:
                known = ", ".join(sorted(set(aliases.values())))
                raise InvalidArgumentError(
                    f"unknown kernel package {token!r} in platform spec {text!r}; "
                    f"known packages: {known}, all; expected {GRAMMAR}"
                )
            present.add(aliases[low])
            if pinned:
                dist, at, version = pinned.rpartition("@")
                if (at and not dist) or not version:
                    raise InvalidArgumentError(
                        f"cannot parse the version {pinned!r} of {token!r} in platform spec "
                        f"{text!r}; expected {GRAMMAR}"
                    )
                versions[aliases[low]] = (dist or None, version)
        probes = _package_probes()
        packages = tuple(
            _simulated_fact(p, versions.get(p.name))
            if p.name in present
            else PackageFact(p.name, "missing", None, "not installed")
            for p in probes
        )
        name = f"simulated {kind}" + (f" {arch}" if arch else "")
        return cls(
            kind=kind,
            device_name=name,
            capability=capability,
            arch=arch,
            torch_version=SIMULATED_TORCH_VERSION,
            packages=packages,
            simulated=True,
        )

    @classmethod
    def detect(cls, *, refresh: bool = False) -> Platform:
        """Probe this machine (once per process unless ``refresh``).

        A backend registered after the first detection that names a package not
        probed yet has that package probed on the next call (the facts already
        known are kept): the registry generation invalidates the detected facts
        like every other cache.
        """
        global _DETECTED, _DETECTED_AT
        with _DETECT_LOCK:
            if _DETECTED is None or refresh:
                _DETECTED = _probe()
            elif registry_generation() != _DETECTED_AT:
                _DETECTED = _with_new_packages(_DETECTED)
            _DETECTED_AT = registry_generation()
            return _DETECTED


_DETECTED: Platform | None = None
#: the registry generation the detected facts were checked against (attnres._memo)
_DETECTED_AT = -1


def _with_new_packages(platform: Platform) -> Platform:
    """``platform`` with the packages the registered backends name now: those
    probed already keep their facts, new ones are probed, and those no backend
    names any more are dropped (as a fresh probe would)."""
    known = {fact.name: fact for fact in platform.packages}
    packages = tuple(
        known[p.name] if p.name in known else probe_package(p) for p in _package_probes()
    )
    if packages == platform.packages:
        return platform
    return attrs.evolve(platform, packages=packages)


def detected_platform() -> Platform:
    """This machine's facts, probed once: :meth:`Platform.detect` without the lock
    while they are current (the resolver asks on every call)."""
    detected = _DETECTED
    if detected is not None and registry_generation() == _DETECTED_AT:
        return detected
    return Platform.detect()


_DETECT_LOCK = threading.Lock()


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    # A path that is not UTF-8 comes back with surrogate escapes (\udcff), which
    # no UTF-8 trace, digest or log line can hold: keep them visible, escaped.
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _dist_version(names: Iterable[str]) -> tuple[str, str] | None:
    for dist in names:
        try:
            return dist, metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
        except Exception:  # a corrupt METADATA must not stop start-up
            continue
    return None


def _submodule_exists(module: str) -> bool:
    """Whether ``a.b.c`` can be found on disk, without importing ``a`` or ``a.b``.

    (``importlib.util.find_spec("a.b")`` imports ``a``, whose import may be the
    very thing that is broken.)
    """
    parts = module.split(".")
    spec = importlib.util.find_spec(parts[0])
    for i in range(1, len(parts)):
        if spec is None or spec.submodule_search_locations is None:
            return False
        spec = importlib.machinery.PathFinder.find_spec(
            ".".join(parts[: i + 1]), list(spec.submodule_search_locations)
        )
    return spec is not None


#: How much of what a package printed while imported is kept in its fact.
_MAX_PRINTED = 500


class _Printed:
    """What was written to stdout inside :func:`_stdout_captured` (``.text``)."""

    text = ""


@contextlib.contextmanager
def _stdout_captured() -> Iterator[_Printed]:
    """Keep third-party output off stdout while a package is probed.

    ``print`` in an imported module (Python level: ``sys.stdout``) and a C
    extension's ``printf`` (file-descriptor level: fd 1) both go to a temporary
    file instead; what they wrote is handed back, so the probe can keep it (it
    is often the diagnosis). stdout is the channel of ``--json`` output.
    """
    printed = _Printed()
    buffer = io.StringIO()
    with contextlib.suppress(OSError, ValueError, AttributeError):
        sys.stdout.flush()
    with tempfile.TemporaryFile() as sink:
        saved_fd: int | None = None
        try:
            saved_fd = os.dup(1)
            os.dup2(sink.fileno(), 1)
        except (OSError, ValueError):  # no fd 1 (a closed stdout): Python level only
            if saved_fd is not None:
                os.close(saved_fd)
                saved_fd = None
        raw = b""
        try:
            with contextlib.redirect_stdout(buffer):
                yield printed
        finally:
            if saved_fd is not None:
                _flush_c_stdout()
                os.dup2(saved_fd, 1)
                os.close(saved_fd)
                sink.seek(0)
                raw = sink.read(_MAX_PRINTED * 4)
            text = buffer.getvalue() + raw.decode("utf-8", "backslashreplace")
            printed.text = " ".join(text.split())


def _flush_c_stdout() -> None:
    """Flush C stdio's buffer, so a ``printf`` without a newline lands in the capture."""
    try:
        import ctypes

        ctypes.CDLL(None).fflush(None)
    except Exception:  # no libc to call: what is buffered stays buffered
        pass


def _with_printed(fact: PackageFact, printed: str) -> PackageFact:
    if not printed:
        return fact
    if len(printed) > _MAX_PRINTED:
        printed = printed[:_MAX_PRINTED] + "..."
    note = f"printed on import: {printed}"
    detail = f"{fact.detail}; {note}" if fact.detail else note
    return attrs.evolve(fact, detail=detail)


def probe_package(probe: PackageProbe) -> PackageFact:
    """Probe one package; never raises (KeyboardInterrupt aside).

    Nothing the package prints while imported reaches stdout; it is kept in the
    fact's ``detail`` (``printed on import: ...``).
    """
    with _stdout_captured() as printed:
        fact = _probe_package(probe)
    return _with_printed(fact, printed.text)


def _probe_package(probe: PackageProbe) -> PackageFact:
    try:
        top = probe.module.split(".")[0]
        if importlib.util.find_spec(top) is None:
            return PackageFact(probe.name, "missing", None, "not installed")
        dist = _dist_version(probe.distributions)
        if dist is None and not _submodule_exists(probe.module):
            # The parent package is there (flash_attn 2.x) but the submodule
            # (flash_attn.cute) is not, and no distribution claims it: this
            # package is simply not installed, not broken.
            return PackageFact(probe.name, "missing", None, "not installed")
        impostor = _dist_version(probe.impostors)
        host = _dist_version(probe.hosts) if dist is None else None
        if dist is None and impostor is not None:
            return PackageFact(
                probe.name,
                "missing",
                None,
                f"module {probe.module!r} belongs to {impostor[0]} {impostor[1]}, "
                f"not to {probe.distributions[0]}",
            )
        module = importlib.import_module(probe.module)
        owner = dist or host
        version = owner[1] if owner else getattr(module, "__version__", None)
        return PackageFact(
            probe.name,
            "present",
            str(version) if version else None,
            None,
            owner[0] if owner else None,
        )
    except KeyboardInterrupt:
        raise
    except BaseException as exc:
        return PackageFact(probe.name, "broken", None, f"import failed: {_describe(exc)}")


def _probe() -> Platform:
    with _stdout_captured() as printed:
        platform = _probe_uncaptured()
    if printed.text:  # torch or a plugin printed while imported
        text = printed.text[:_MAX_PRINTED] + ("..." if len(printed.text) > _MAX_PRINTED else "")
        platform = attrs.evolve(platform, notes=(*platform.notes, f"printed on import: {text}"))
    return platform


def _probe_uncaptured() -> Platform:
    notes: list[str] = []
    kind, device, capability, arch = "cpu", "cpu", None, None
    torch_version: str | None = None
    try:
        import torch

        torch_version = str(torch.__version__).split("+")[0]
        try:
            if torch.cuda.is_available():
                props = torch.cuda.get_device_properties(0)
                device = str(props.name)
                if getattr(torch.version, "hip", None):
                    kind = "rocm"
                    arch = str(getattr(props, "gcnArchName", "")).split(":")[0] or None
                else:
                    kind = "cuda"
                    major, minor = torch.cuda.get_device_capability(0)
                    capability = (int(major), int(minor))
                    arch = f"sm{capability[0]}{capability[1]}"
        except Exception as exc:
            notes.append(f"torch.cuda query failed: {_describe(exc)}")
            kind, device, capability, arch = "cpu", "cpu", None, None
        if kind == "cpu":
            for name in ("mps", "xpu", "npu"):
                try:
                    backend_mod = getattr(torch.backends, name, None) if name == "mps" else None
                    available = (
                        backend_mod.is_available()
                        if backend_mod is not None
                        else bool(
                            getattr(torch, name, None) and getattr(torch, name).is_available()
                        )
                    )
                except Exception as exc:
                    notes.append(f"torch.{name} query failed: {_describe(exc)}")
                    continue
                if available:
                    kind, device = name, name
                    break
    except Exception as exc:
        notes.append(f"torch import failed: {_describe(exc)}")
    packages = tuple(probe_package(p) for p in _package_probes())
    for failure in plugin_failures():
        notes.append(f"plugin {failure.entry_point} failed to load: {failure.error}")
    return Platform(
        kind=kind,
        device_name=device,
        capability=capability,
        arch=arch,
        torch_version=torch_version,
        packages=packages,
        notes=tuple(notes),
    )
