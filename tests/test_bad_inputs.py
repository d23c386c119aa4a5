"""The bad-input catalogue: every malformed input attnres accepts from users, in
one table, with the exact error it gives and a piece of the message users see.

Each case is one of:

- ``call``: a library call that must raise exactly ``expected`` (the exception's
  type, not a subclass of it);
- ``argv``: an ``attnres`` command line that must exit with ``expected`` (2: bad
  usage or input), print nothing on stdout, and explain itself on stderr in one
  paragraph without a traceback;
- ``file``: a file's content (a pipeline ``.toml`` or a trace ``.json``): the
  library's loader must raise ``expected`` and the command that reads such a
  file (``attnres plan`` / ``attnres replay``) must exit 2, with the same
  message on stderr;
- ``folder``: a model folder (``tests/tiny_folders.py`` builds it, one file
  edited): ``attnres.integrations.plan_folder`` must raise ``expected`` and
  ``attnres plan DIR`` must exit 2 with the same message (issue 20).

``docs/errors.md`` documents the catalogue: the error types, each mistake's
message and what to do, the exit codes and the rejection codes.
"""

from __future__ import annotations

import json
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_folders import tiny_folder, with_file, with_header, with_special

import attnres
from attnres import (
    Attention,
    Backend,
    BackendNotAppliedError,
    LayerSpec,
    Platform,
    Requirements,
    ResolutionError,
    SelectionConfig,
    TraceFormatError,
    UnknownBackendError,
    component_scope,
    force_backend,
    resolve,
)
from attnres.backends import BackendSpec, register_backend, unregister_backend
from attnres.cli import main
from attnres.errors import PluginError, ResultsFileError
from attnres.integrations import FolderBuildError
from attnres.machine import run_machine
from attnres.modules import KernelNotRegisteredError
from attnres.plan import PipelineError, load_pipeline
from attnres.scope import register_component_kind
from attnres.trace import TraceInput, load_trace

CPU = Platform.simulate("cpu")
H100 = Platform.simulate("cuda:sm90+all")


@dataclass(frozen=True)
class Case:
    id: str
    expected: type[BaseException] | int
    fragment: str
    call: Callable[[], object] | None = None
    argv: tuple[str, ...] | None = None
    file: tuple[str, str | bytes] | None = None  # (suffix, content)
    #: issue 20: builds a model folder under the given path and returns it; the
    #: library's plan_folder must raise ``expected`` and ``attnres plan DIR`` exit 2
    folder: Callable[[Path], Path] | None = None

    def __repr__(self) -> str:
        return self.id


def _scope(*args: Any, **kwargs: Any) -> None:
    with component_scope(*args, **kwargs):
        pass


def _forward(
    q: tuple[int, ...],
    kv: tuple[int, ...] | None = None,
    *,
    dtype: Any = None,
    kv_dtype: Any = None,
) -> object:
    layer = Attention(8, 64, platform=CPU)
    kv = q if kv is None else kv
    qt = torch.zeros(q, dtype=dtype or torch.float32)
    kt = torch.zeros(kv, dtype=kv_dtype or dtype or torch.float32)
    return layer(qt, kt, kt)


def _enter_forced(name: Any) -> None:
    with force_backend(name):
        pass


_SPEC = dict(sparse=False, platforms=("cpu",), dtypes=("float32",))


def _pipeline(layer: str = "", component: str = "", top: str = "") -> str:
    """A valid pipeline file with extra lines in the layer, the component, the top."""
    return textwrap.dedent(
        """\
            [pipeline]
            name = "bad-inputs"
            {top}
            [[components]]
            name = "vae"
            {component}
            [[components.layers]]
            name = "mid.attn"
            {layer}
            """
    ).format(top=top, component=component, layer=layer)


_LAYER_OK = 'head_size = 64\ndtype = "float32"'


def _valid_trace_doc() -> dict[str, Any]:
    return run_machine(
        TraceInput(LayerSpec(64, "float32", name="mid.attn"), SelectionConfig(), None, CPU)
    ).to_dict()


def _trace(edit: Callable[[dict[str, Any]], object]) -> str:
    doc = _valid_trace_doc()
    edit(doc)
    return json.dumps(doc, indent=2)


_VALID_TRACE = json.dumps(_valid_trace_doc(), indent=2)
_UNKNOWN = "Unknown attention backend"

CASES: list[Case] = [
    # -- layer specs ----------------------------------------------------------
    Case(
        "layer-head-size-0",
        ValueError,
        "head_size: must be at least 1, got 0",
        call=lambda: LayerSpec(0, "fp32"),
    ),
    Case(
        "layer-head-size-negative",
        ValueError,
        "head_size: must be at least 1, got -1",
        call=lambda: LayerSpec(-1, "fp32"),
    ),
    Case(
        "layer-head-size-bool",
        ValueError,
        "head_size: expected a positive integer, got True",
        call=lambda: LayerSpec(True, "fp32"),
    ),
    Case(
        "layer-head-size-str",
        ValueError,
        "head_size: expected a positive integer, got '64'",
        call=lambda: LayerSpec("64", "fp32"),
    ),
    Case(
        "layer-head-size-float",
        ValueError,
        "head_size: expected a positive integer, got 64.0",
        call=lambda: LayerSpec(64.0, "fp32"),
    ),
    Case(
        "layer-unknown-dtype",
        ValueError,
        "dtype: unknown dtype 'int8'; use one of float16",
        call=lambda: LayerSpec(64, "int8"),
    ),
    Case(
        "layer-unsupported-torch-dtype",
        ValueError,
        "dtype: unknown dtype torch.int8",
        call=lambda: LayerSpec(64, torch.int8),
    ),
    Case(
        "layer-unknown-backend-in-supported",
        UnknownBackendError,
        "supported: Unknown attention backend 'flash_atn'. Did you mean 'fa'? Valid backends: ",
        call=lambda: LayerSpec(64, "fp32", supported=["torch_sdpa", "flash_atn"]),
    ),
    Case(
        "layer-empty-supported",
        ValueError,
        "supported: an empty set admits no backend; pass None",
        call=lambda: LayerSpec(64, "fp32", supported=[]),
    ),
    Case(
        "layer-supported-not-a-set",
        ValueError,
        "supported: expected a set of backend names, got 5",
        call=lambda: LayerSpec(64, "fp32", supported=5),
    ),
    Case(
        "layer-supported-non-string",
        ValueError,
        "supported: backend must be a Backend or a str, got int",
        call=lambda: LayerSpec(64, "fp32", supported=[3]),
    ),
    Case(
        "layer-unknown-default",
        UnknownBackendError,
        "default: Unknown attention backend 'sage_atn'. Did you mean 'sage_attn'?",
        call=lambda: LayerSpec(64, "fp32", default="sage_atn"),
    ),
    Case(
        "layer-bad-role",
        ValueError,
        "role must be 'self' or 'cross', got 'bidirectional'",
        call=lambda: LayerSpec(64, "fp32", role="bidirectional"),
    ),
    Case(
        "layer-unknown-requirement",
        ValueError,
        "requirements: unknown requirement 'casual' (did you mean 'causal'?); valid: causal, "
        "attn_mask, packed_varlen",
        call=lambda: LayerSpec(64, "fp32", requirements=["casual"]),
    ),
    Case(
        "requirements-from-a-string",
        ValueError,
        "requirements: unknown requirement 'casual'",
        call=lambda: Requirements.of("causal,casual"),
    ),
    Case(
        "layer-name-not-a-string",
        ValueError,
        "name: expected a string, got 5",
        call=lambda: LayerSpec(64, "fp32", name=5),
    ),
    # -- platform strings -----------------------------------------------------
    Case(
        "platform-unknown-kind",
        ValueError,
        "unknown platform kind 'gpu' in 'gpu'; expected KIND[:ARCH][+PACKAGE...]",
        call=lambda: Platform.simulate("gpu"),
    ),
    Case(
        "platform-bad-cuda-arch",
        ValueError,
        "cannot parse CUDA architecture 'hopper' in 'cuda:hopper' (use sm80, sm90",
        call=lambda: Platform.simulate("cuda:hopper"),
    ),
    Case(
        "platform-bad-rocm-arch",
        ValueError,
        "cannot parse ROCm architecture 'mi300' in 'rocm:mi300' (use gfx90a",
        call=lambda: Platform.simulate("rocm:mi300"),
    ),
    # issue 11, case 9: an architecture the platform kind cannot have
    Case(
        "platform-cpu-with-cuda-arch",
        ValueError,
        "platform kind 'cpu' takes no architecture, got 'sm90' in 'cpu:sm90'; did you mean "
        "'cuda:sm90'? (only cuda and rocm take one); expected KIND[:ARCH][+PACKAGE...]",
        call=lambda: Platform.simulate("cpu:sm90"),
    ),
    Case(
        "platform-npu-with-arch",
        ValueError,
        "platform kind 'npu' takes no architecture, got 'foo' in 'npu:foo' (only cuda and "
        "rocm take one)",
        call=lambda: Platform.simulate("npu:foo"),
    ),
    Case(
        "platform-xpu-with-rocm-arch",
        ValueError,
        "platform kind 'xpu' takes no architecture, got 'gfx942' in 'xpu:gfx942'; did you "
        "mean 'rocm:gfx942'?",
        call=lambda: Platform.simulate("xpu:gfx942"),
    ),
    Case(
        "cli-platform-cpu-with-cuda-arch",
        2,
        "platform kind 'cpu' takes no architecture, got 'sm90' in 'cpu:sm90'; did you mean "
        "'cuda:sm90'?",
        argv=("explain", "--head-size", "64", "--dtype", "bf16", "--platform", "cpu:sm90"),
    ),
    Case(
        "platform-unknown-package",
        ValueError,
        "unknown kernel package 'flashattn' in platform spec 'cuda:sm90+flashattn'; known "
        "packages: aiter, fastvideo_kernel, flash_attn,",
        call=lambda: Platform.simulate("cuda:sm90+flashattn"),
    ),
    Case(
        "platform-empty",
        ValueError,
        "cannot parse platform spec ''; expected KIND[:ARCH]",
        call=lambda: Platform.simulate(""),
    ),
    Case(
        "platform-space",
        ValueError,
        "cannot parse platform spec 'cuda sm90'; expected ",
        call=lambda: Platform.simulate("cuda sm90"),
    ),
    Case(
        "platform-not-a-string",
        ValueError,
        "platform spec must be a string in the form KIND[:ARCH][+PACKAGE...]",
        call=lambda: Platform.simulate(None),
    ),  # type: ignore[arg-type]
    Case(
        "platform-kind-field",
        ValueError,
        "platform kind must be one of cpu, cuda, rocm",
        call=lambda: Platform(kind="tpu"),
    ),
    # -- backend names --------------------------------------------------------
    Case(
        "backend-unknown-with-suggestion",
        UnknownBackendError,
        "Unknown attention backend 'sage_atn'. Did you mean 'sage_attn'? Valid backends: aiter,",
        call=lambda: Backend.parse("sage_atn"),
    ),
    Case(
        "backend-unknown-no-suggestion",
        UnknownBackendError,
        "Unknown attention backend 'zzzz'. Valid backends: aiter, ascend_fa,",
        call=lambda: Backend.parse("zzzz"),
    ),
    Case(
        "backend-not-a-string",
        TypeError,
        "backend must be a Backend or a str, got int",
        call=lambda: Backend.parse(3),
    ),  # type: ignore[arg-type]
    Case(
        "resolve-unknown-layer-backend",
        UnknownBackendError,
        "backend: Unknown attention backend 'fz'. Did you mean 'fa'?",
        call=lambda: resolve(LayerSpec(64, "fp32"), platform=CPU, backend="fz"),
    ),
    Case(
        "force-backend-unknown",
        UnknownBackendError,
        "backend: Unknown attention backend 'nope'",
        call=lambda: _enter_forced("nope"),
    ),
    Case(
        "force-backend-none",
        ValueError,
        "force_backend: backend must be a backend name",
        call=lambda: _enter_forced(None),
    ),
    Case(
        "unregister-unknown",
        UnknownBackendError,
        "Unknown attention backend 'nope'",
        call=lambda: unregister_backend("nope"),
    ),
    # -- selection configs ----------------------------------------------------
    Case(
        "config-unknown-global-backend",
        UnknownBackendError,
        "global_backend: Unknown attention backend 'flash'. Did you mean 'fa'?",
        call=lambda: SelectionConfig(global_backend="flash"),
    ),
    Case(
        "config-global-backend-not-a-string",
        ValueError,
        "global_backend: backend must be a Backend or a str, got int",
        call=lambda: SelectionConfig(global_backend=5),
    ),  # type: ignore[arg-type]
    Case(
        "config-unknown-forced-backend",
        UnknownBackendError,
        "forced_backend: Unknown attention backend 'nope'",
        call=lambda: SelectionConfig(forced_backend="nope"),
    ),
    Case(
        "config-unknown-component-backend",
        UnknownBackendError,
        "component_backends['vae']: Unknown attention backend 'nope'",
        call=lambda: SelectionConfig(component_backends={"vae": "nope"}),
    ),
    Case(
        "config-empty-component-name",
        ValueError,
        "component_backends: component name must be a non-empty string, got ''",
        call=lambda: SelectionConfig(component_backends={"": "fa"}),
    ),
    Case(
        "set-selection-config-not-a-config",
        TypeError,
        "expected a SelectionConfig, got dict",
        call=lambda: attnres.set_selection_config({"global_backend": "fa"}),
    ),  # type: ignore
    # -- resolve() arguments --------------------------------------------------
    Case(
        "resolve-not-a-layer",
        TypeError,
        "resolve() takes a LayerSpec, got dict",
        call=lambda: resolve({"head_size": 64}),
    ),  # type: ignore[arg-type]
    Case(
        "resolve-config-not-a-config",
        TypeError,
        "resolve(): config must be an attnres.SelectionConfig, got dict",
        call=lambda: resolve(LayerSpec(64, "fp32"), config={"a": 1}, platform=CPU),
    ),  # type: ignore
    Case(
        "resolve-platform-string",
        TypeError,
        "resolve(): platform must be an attnres.Platform (Platform.detect() or "
        "Platform.simulate('cuda:sm90+flash_attn')), got str",
        call=lambda: resolve(LayerSpec(64, "fp32"), platform="cpu"),
    ),  # type: ignore[arg-type]
    # -- rejections (ResolutionError, a ValueError carrying the trace) ---------
    Case(
        "rejected-not-supported",
        ResolutionError,
        "Attention backend 'torch_sdpa' is not supported by this attention layer; supported "
        "backends: ['fa']",
        call=lambda: resolve(
            LayerSpec(64, "bf16", supported=["fa"]), platform=H100, backend="torch_sdpa"
        ),
    ),
    Case(
        "rejected-packed-varlen",
        ResolutionError,
        "Attention backend 'torch_sdpa' does not implement packed varlen attention",
        call=lambda: resolve(
            LayerSpec(64, "bf16", requirements=["packed_varlen"]),
            platform=H100,
            backend="torch_sdpa",
        ),
    ),
    Case(
        "rejected-platform",
        ResolutionError,
        "Attention backend 'fa' cannot run this layer on cpu (simulated): runs on cuda, rocm, "
        "not on cpu",
        call=lambda: resolve(LayerSpec(64, "fp32"), platform=CPU, backend="fa"),
    ),
    Case(
        "rejected-no-compatible-backend",
        ResolutionError,
        "No compatible attention backend is available: tried torch_sdpa (platform_default): "
        "does not take dtype float8_e4m3fn",
        call=lambda: resolve(LayerSpec(64, "fp8"), platform=CPU),
    ),
    Case(
        "rejected-sparse-cross-only",
        ResolutionError,
        "No compatible attention backend is available: tried sliding_tile_attn (supported_set): "
        "Sparse attention backend 'sliding_tile_attn' cannot serve cross-attention",
        call=lambda: resolve(
            LayerSpec(64, "bf16", role="cross", supported=["sliding_tile_attn"]), platform=H100
        ),
    ),
    # -- component_scope arguments --------------------------------------------
    Case(
        "scope-empty-name",
        ValueError,
        "component_scope: name must be a non-empty string, got ''",
        call=lambda: _scope(""),
    ),
    Case(
        "scope-blank-name",
        ValueError,
        "component_scope: name must be a non-empty string, got '   '",
        call=lambda: _scope("   "),
    ),
    Case(
        "scope-name-none",
        ValueError,
        "component_scope: name must be a non-empty string, got None",
        call=lambda: _scope(None),
    ),
    Case(
        "scope-unknown-role",
        ValueError,
        "role must be 'self' or 'cross', got 'bidirectional'",
        call=lambda: _scope("vae", role_backends={"bidirectional": "fa"}),
    ),
    Case(
        "scope-role-backends-not-a-mapping",
        ValueError,
        "role_backends: expected a mapping role -> backend, got ['cross']",
        call=lambda: _scope("vae", role_backends=["cross"]),
    ),
    Case(
        "scope-role-backend-none",
        ValueError,
        "role_backends['cross']: backend must not be None",
        call=lambda: _scope("vae", role_backends={"cross": None}),
    ),
    Case(
        "scope-role-backend-unknown",
        UnknownBackendError,
        "role_backends['cross']: Unknown attention backend 'nope'",
        call=lambda: _scope("vae", role_backends={"cross": "nope"}),
    ),
    Case(
        "scope-unknown-backend",
        UnknownBackendError,
        "backend: Unknown attention backend 'nope'",
        call=lambda: _scope("vae", backend="nope"),
    ),
    Case(
        "scope-bad-kind",
        ValueError,
        "unknown component kind 'vea'; registered kinds: audio_vae, bridge, component",
        call=lambda: _scope("vae", kind="vea"),
    ),
    Case(
        "scope-override-not-applied",
        BackendNotAppliedError,
        "backend 'fa' was requested for component 'vae', but the scope built no attnres "
        "attention layer",
        call=lambda: _scope("vae", backend="fa"),
    ),
    Case(
        "component-kind-bad-name",
        ValueError,
        "component kind must be lower-case snake_case, got 'Bad Kind'",
        call=lambda: register_component_kind("Bad Kind"),
    ),
    Case(
        "component-kind-bad-loader",
        TypeError,
        "loader must be a ComponentLoader subclass",
        call=lambda: register_component_kind("ok_kind", loader=int),
    ),  # type: ignore[arg-type]
    # -- backend registration ---------------------------------------------------
    Case(
        "backend-spec-bad-name",
        ValueError,
        "backend name must be lower-case letters, digits and '_', got 'Bad-Name'",
        call=lambda: BackendSpec(name="Bad-Name", **_SPEC),
    ),  # type: ignore[arg-type]
    Case(
        "backend-spec-unknown-platform",
        ValueError,
        "platforms: unknown platform kinds ['gpu']",
        call=lambda: BackendSpec(name="k", sparse=False, platforms=("gpu",), dtypes=("float32",)),
    ),
    Case(
        "register-builtin-name",
        PluginError,
        "backend 'fa' (from register_backend()) is already registered by the built-in catalogue",
        call=lambda: register_backend(BackendSpec(name="fa", **_SPEC)),
    ),  # type: ignore[arg-type]
    Case(
        "register-taken-alias",
        PluginError,
        "the name 'sdpa' already belongs to backend 'torch_sdpa'",
        call=lambda: register_backend(BackendSpec(name="my_kernel", aliases=("sdpa",), **_SPEC)),
    ),  # type: ignore[arg-type]
    # -- Attention construction -------------------------------------------------
    Case(
        "attention-kv-heads-not-dividing",
        ValueError,
        "num_kv_heads: 3 does not divide num_heads 8; grouped-query attention needs",
        call=lambda: Attention(8, 64, num_kv_heads=3, platform=CPU),
    ),
    Case(
        "attention-bad-dtype",
        ValueError,
        "dtype: unknown dtype 'int8'",
        call=lambda: Attention(8, 64, dtype="int8", platform=CPU),
    ),
    Case(
        "attention-zero-heads",
        ValueError,
        "num_heads: expected a positive integer, got 0",
        call=lambda: Attention(0, 64, platform=CPU),
    ),
    Case(
        "attention-negative-head-size",
        ValueError,
        "head_size: expected a positive integer, got -64",
        call=lambda: Attention(8, -64, platform=CPU),
    ),
    Case(
        "attention-causal-not-bool",
        ValueError,
        "causal: expected a bool, got 'yes'",
        call=lambda: Attention(8, 64, causal="yes", platform=CPU),
    ),  # type: ignore[arg-type]
    Case(
        "attention-scale-nan",
        ValueError,
        "softmax_scale: expected a finite number, got nan",
        call=lambda: Attention(8, 64, softmax_scale=float("nan"), platform=CPU),
    ),
    Case(
        "attention-sparse-backend-has-no-kernel",
        ResolutionError,
        "Attention backend 'sliding_tile_attn' is not available: no kernel in this process "
        "(a sparse backend",
        call=lambda: Attention(8, 64, dtype="bf16", backend="sliding_tile_attn", platform=H100),
    ),
    # -- Attention.forward inputs -------------------------------------------------
    Case(
        "forward-wrong-head-size",
        ValueError,
        "head size: expected 64; got q (1, 4, 8, 32)",
        call=lambda: _forward((1, 4, 8, 32)),
    ),
    Case(
        "forward-wrong-heads",
        ValueError,
        "heads: q has 4 heads, expected 8",
        call=lambda: _forward((1, 4, 4, 64), (1, 4, 8, 64)),
    ),
    Case(
        "forward-wrong-kv-heads",
        ValueError,
        "heads: k and v must have 8 heads",
        call=lambda: _forward((1, 4, 8, 64), (1, 4, 4, 64)),
    ),
    Case(
        "forward-wrong-rank",
        ValueError,
        "rank: q must have 4 dims (batch, seq, heads, head_size), got 3",
        call=lambda: _forward((4, 8, 64), (1, 4, 8, 64)),
    ),
    Case(
        "forward-wrong-dtype",
        ValueError,
        "dtype: backend 'torch_sdpa' cannot take torch.int32 (it takes bfloat16, float16, "
        "float32, float64); this layer was resolved for float32",
        call=lambda: _forward((1, 4, 8, 64), dtype=torch.int32),
    ),
    Case(
        "forward-mixed-dtypes",
        ValueError,
        "dtype: q, k and v must have the same dtype, got torch.float32, torch.float64",
        call=lambda: _forward((1, 4, 8, 64), kv_dtype=torch.float64),
    ),
    Case(
        "forward-batch-mismatch",
        ValueError,
        "batch: q, k and v must have the same batch size",
        call=lambda: _forward((1, 4, 8, 64), (2, 4, 8, 64)),
    ),
    # -- pipeline files (attnres plan) ---------------------------------------------
    Case(
        "toml-syntax-error",
        PipelineError,
        "input.toml:10: invalid TOML: Illegal character",
        file=(".toml", _pipeline('head_size = 64\ndtype = "float32')),
    ),
    Case(
        "toml-not-utf8",
        PipelineError,
        "input.toml: not UTF-8 text",
        file=(".toml", b'[pipeline]\nname = "\xff"\n'),
    ),
    Case(
        "toml-empty",
        PipelineError,
        "input.toml: no components: add at least one [[components]] table",
        file=(".toml", ""),
    ),
    Case(
        "toml-missing-head-size",
        PipelineError,
        "component 'vae' (components[0]): layer 'mid.attn' (layers[0]): missing required key "
        "'head_size'",
        file=(".toml", _pipeline('dtype = "float32"')),
    ),
    Case(
        "toml-unknown-layer-key",
        PipelineError,
        "unknown key 'head_sizes' in a layer (did you mean 'head_size'?); allowed keys: name,",
        file=(".toml", _pipeline('head_sizes = 64\ndtype = "float32"')),
    ),
    Case(
        "toml-unknown-top-key",
        PipelineError,
        "unknown key 'component' in the top level",
        file=(".toml", _pipeline(_LAYER_OK, top='[component]\nname = "x"')),
    ),
    Case(
        "toml-head-size-string",
        PipelineError,
        "head_size must be an integer, got a string ('64')",
        file=(".toml", _pipeline('head_size = "64"\ndtype = "float32"')),
    ),
    Case(
        "toml-head-size-zero",
        PipelineError,
        "head_size: must be at least 1, got 0",
        file=(".toml", _pipeline('head_size = 0\ndtype = "float32"')),
    ),
    Case(
        "toml-count-zero",
        PipelineError,
        "count must be a positive integer, got 0",
        file=(".toml", _pipeline(_LAYER_OK + "\ncount = 0")),
    ),
    Case(
        "toml-bad-role",
        PipelineError,
        "role must be 'self' or 'cross', got 'both'",
        file=(".toml", _pipeline(_LAYER_OK + '\nrole = "both"')),
    ),
    Case(
        "toml-bad-role-in-role-backends",
        PipelineError,
        "role_backends: role must be 'self' or 'cross', got 'both'",
        file=(".toml", _pipeline(_LAYER_OK, component='role_backends = { both = "fa" }')),
    ),
    Case(
        "toml-unknown-backend",
        PipelineError,
        "component 'vae' (components[0]): backend: Unknown attention backend 'sage_atn'. Did "
        "you mean 'sage_attn'?",
        file=(".toml", _pipeline(_LAYER_OK, component='backend = "sage_atn"')),
    ),
    Case(
        "toml-unknown-backend-in-supported",
        PipelineError,
        "layer 'mid.attn' (layers[0]): supported: Unknown attention backend 'flash_atn'",
        file=(".toml", _pipeline(_LAYER_OK + '\nsupported = ["flash_atn"]')),
    ),
    Case(
        "toml-unknown-dtype",
        PipelineError,
        "dtype: unknown dtype 'int8'",
        file=(".toml", _pipeline('head_size = 64\ndtype = "int8"')),
    ),
    Case(
        "toml-unknown-kind",
        PipelineError,
        "kind: unknown component kind 'vea'",
        file=(".toml", _pipeline(_LAYER_OK, component='kind = "vea"')),
    ),
    Case(
        "toml-duplicate-component",
        PipelineError,
        "duplicate component name 'vae'",
        file=(
            ".toml",
            _pipeline(_LAYER_OK) + '[[components]]\nname = "vae"\n'
            '[[components.layers]]\nname = "x"\n' + _LAYER_OK + "\n",
        ),
    ),
    Case(
        "toml-allow-global-fallback-string",
        PipelineError,
        "allow_global_fallback must be true or false, got 'no'",
        file=(".toml", _pipeline(_LAYER_OK, component='allow_global_fallback = "no"')),
    ),
    # issue 11, cases 6 and 7
    Case(
        "toml-nested-too-deeply",
        PipelineError,
        "input.toml: not a pipeline: TOML nested too deeply",
        file=(".toml", "a = " + "[" * 500 + "]" * 500 + "\n"),
    ),
    Case(
        "toml-integer-too-long",
        PipelineError,
        "input.toml:9: invalid TOML: a number of 5000 digits is too long to read (at most 4300",
        file=(".toml", _pipeline("head_size = " + "9" * 5000 + '\ndtype = "float32"')),
    ),
    Case(
        "toml-utf8-bom",
        PipelineError,
        "input.toml:1: the file starts with a UTF-8 byte-order mark (BOM), which TOML does "
        "not allow; save it as UTF-8 without a BOM",
        file=(".toml", b"\xef\xbb\xbf" + _pipeline(_LAYER_OK).encode()),
    ),
    Case(
        "pipeline-is-a-directory",
        PipelineError,
        "is a directory, not a pipeline file",
        call=lambda: load_pipeline(Path(__file__).parent),
    ),
    # -- trace files (attnres replay) -------------------------------------------------
    Case(
        "trace-empty",
        TraceFormatError,
        "input.json: $: the file is empty, not a trace",
        file=(".json", ""),
    ),
    Case(
        "trace-truncated-between-values",
        TraceFormatError,
        "input.json: $: not valid JSON: Expecting ',' delimiter at line 4, column 1; the file "
        "looks truncated",
        file=(".json", '{\n  "digest": "00",\n  "input": {}\n'),
    ),
    Case(
        "trace-truncated-in-a-string",
        TraceFormatError,
        "input.json: $: not valid JSON: Unterminated string starting at line 3, column 12; the "
        "file looks truncated",
        file=(".json", '{\n  "digest": "00",\n  "input": "abc'),
    ),
    Case(
        "trace-not-json",
        TraceFormatError,
        "input.json: $: not valid JSON: Expecting value",
        file=(".json", "schema_version: 1\n"),
    ),
    Case(
        "trace-not-utf8",
        TraceFormatError,
        "input.json: $: not UTF-8 text (byte 0xff",
        file=(".json", b'{"schema_version": 1, "x": "\xff"}'),
    ),
    Case(
        "trace-integer-too-long",
        TraceFormatError,
        "input.json: $: an integer of 5000 digits (a trace holds none longer than 100)",
        file=(".json", '{"schema_version": ' + "9" * 5000 + "}"),
    ),
    Case(
        "trace-nan",
        TraceFormatError,
        "NaN is not valid JSON",
        file=(".json", '{"schema_version": NaN}'),
    ),
    Case(
        "trace-not-an-object",
        TraceFormatError,
        "$: a trace must be a JSON object, got a list",
        file=(".json", "[]"),
    ),
    Case(
        "trace-not-a-trace",
        TraceFormatError,
        "$.schema_version: missing field; this is not an attnres trace",
        file=(".json", '{"name": "x"}'),
    ),
    Case(
        "trace-wrong-type",
        TraceFormatError,
        '$.input.layer.head_size: expected an integer, got the string "64"',
        file=(".json", _trace(lambda d: d["input"]["layer"].update(head_size="64"))),
    ),
    Case(
        "trace-wrong-bool",
        TraceFormatError,
        '$.input.config.global_backend_explicit: expected true or false, got the string "true"',
        file=(
            ".json",
            _trace(lambda d: d["input"]["config"].update(global_backend_explicit="true")),
        ),
    ),
    Case(
        "trace-unknown-record-kind",
        TraceFormatError,
        '$.records[0].kind: unknown record kind "teleport"; known kinds: origin, transition',
        file=(".json", _trace(lambda d: d["records"][0].update(kind="teleport"))),
    ),
    Case(
        "trace-newer-schema",
        TraceFormatError,
        "$.schema_version: schema version 8 is newer than this attnres reads (up to 7); "
        "upgrade attnres",
        file=(".json", _trace(lambda d: d.update(schema_version=8))),
    ),
    Case(
        "trace-unknown-field",
        TraceFormatError,
        "$.extra: unexpected field",
        file=(".json", _trace(lambda d: d.update(extra=1))),
    ),
    Case(
        "trace-import-path-as-backend",
        TraceFormatError,
        '$.input.layer.default: the string "os:system" is not a backend name',
        file=(".json", _trace(lambda d: d["input"]["layer"].update(default="os:system"))),
    ),
    Case(
        "trace-unknown-backend",
        TraceFormatError,
        "$.input.layer.default: Unknown attention backend 'nope'",
        file=(".json", _trace(lambda d: d["input"]["layer"].update(default="nope"))),
    ),
    Case(
        "trace-edited-by-hand",
        TraceFormatError,
        "$.digest: recorded digest",
        file=(".json", _trace(lambda d: d["input"]["layer"].update(name="edited"))),
    ),
    Case(
        "trace-missing-file",
        TraceFormatError,
        "cannot read the trace file: No such file",
        call=lambda: load_trace(Path(__file__).parent / "no-such-trace.json"),
    ),
    Case(
        "trace-is-a-directory",
        TraceFormatError,
        "cannot read the trace file: it is a directory",
        call=lambda: load_trace(Path(__file__).parent),
    ),
    # -- command-line flags ---------------------------------------------------------------
    Case(
        "cli-head-size-not-an-int",
        2,
        "argument --head-size: invalid int value: 'abc'",
        argv=("explain", "--head-size", "abc", "--dtype", "fp32", "--platform", "cpu"),
    ),
    Case(
        "cli-head-size-zero",
        2,
        "head_size: must be at least 1, got 0",
        argv=("explain", "--head-size", "0", "--dtype", "fp32", "--platform", "cpu"),
    ),
    Case(
        "cli-missing-head-size",
        2,
        "the following arguments are required: --head-size",
        argv=("explain", "--dtype", "fp32", "--platform", "cpu"),
    ),
    Case(
        "cli-unknown-dtype",
        2,
        "dtype: unknown dtype 'int8'",
        argv=("explain", "--head-size", "64", "--dtype", "int8", "--platform", "cpu"),
    ),
    Case(
        "cli-bad-requires",
        2,
        "--requires: unknown requirement 'casual' (did you mean 'causal'?); valid: causal, "
        "attn_mask, packed_varlen",
        argv=(
            "explain",
            "--head-size",
            "64",
            "--dtype",
            "fp32",
            "--requires",
            "causal,casual",
            "--platform",
            "cpu",
        ),
    ),
    Case(
        "cli-bad-role",
        2,
        "role must be 'self' or 'cross', got 'both'",
        argv=(
            "explain",
            "--head-size",
            "64",
            "--dtype",
            "fp32",
            "--role",
            "both",
            "--platform",
            "cpu",
        ),
    ),
    Case(
        "cli-bad-platform",
        2,
        "unknown platform kind 'gpu' in 'gpu'; expected KIND[:ARCH][+PACKAGE...]",
        argv=("explain", "--head-size", "64", "--dtype", "fp32", "--platform", "gpu"),
    ),
    Case(
        "cli-bad-platform-arch",
        2,
        "cannot parse CUDA architecture 'h100'",
        argv=(
            "plan",
            str(Path(__file__).parents[1] / "examples" / "cpu-small.toml"),
            "--platform",
            "cuda:h100",
        ),
    ),
    Case(
        "cli-unknown-backend",
        2,
        "argument --attention-backend: Unknown attention backend 'sage_atn'. Did you mean "
        "'sage_attn'?",
        argv=(
            "explain",
            "--head-size",
            "64",
            "--dtype",
            "fp32",
            "--platform",
            "cpu",
            "--attention-backend",
            "sage_atn",
        ),
    ),
    Case(
        "cli-bad-component-assignment",
        2,
        "argument --attention-backend: expected BACKEND or COMPONENT=BACKEND, got '=fa'",
        argv=(
            "explain",
            "--head-size",
            "64",
            "--dtype",
            "fp32",
            "--platform",
            "cpu",
            "--attention-backend",
            "=fa",
        ),
    ),
    Case(
        "cli-global-backend-twice",
        2,
        "the global backend was given twice ('fa' and 'eager')",
        argv=(
            "explain",
            "--head-size",
            "64",
            "--dtype",
            "fp32",
            "--platform",
            "cpu",
            "--attention-backend",
            "fa",
            "--attention-backend",
            "eager",
        ),
    ),
    Case(
        "cli-unknown-supported",
        2,
        "supported: Unknown attention backend 'nope'",
        argv=(
            "explain",
            "--head-size",
            "64",
            "--dtype",
            "fp32",
            "--supported",
            "fa,nope",
            "--platform",
            "cpu",
        ),
    ),
    Case(
        "cli-component-backend-without-component",
        2,
        "--component-backend is the override of one component: give --component NAME too",
        argv=(
            "explain",
            "--head-size",
            "64",
            "--dtype",
            "fp32",
            "--component-backend",
            "fa",
            "--platform",
            "cpu",
        ),
    ),
    Case(
        "cli-implicit-without-backend",
        2,
        "--implicit marks --attention-backend as derived or defaulted",
        argv=("explain", "--head-size", "64", "--dtype", "fp32", "--implicit", "--platform", "cpu"),
    ),
    Case(
        "cli-empty-component",
        2,
        "component_scope: name must be a non-empty string, got ''",
        argv=(
            "explain",
            "--head-size",
            "64",
            "--dtype",
            "fp32",
            "--component",
            "",
            "--platform",
            "cpu",
        ),
    ),
    Case(
        "cli-plan-unknown-component",
        2,
        "has no component 'unet'; its components: transformer",
        argv=(
            "plan",
            str(Path(__file__).parents[1] / "examples" / "audio-video.toml"),
            "--platform",
            "cpu",
            "--attention-backend",
            "unet=fa",
        ),
    ),
    Case(
        "cli-plan-missing-file",
        2,
        "cannot read pipeline file: No such file or directory",
        argv=("plan", "no-such-pipeline.toml", "--platform", "cpu"),
    ),
    Case(
        "cli-replay-missing-file",
        2,
        "no-such-trace.json: no such file or folder",
        argv=("replay", "no-such-trace.json"),
    ),
    # issue 11, case 8: conflicting per-component flags are usage errors, in either order
    Case(
        "cli-component-given-twice",
        2,
        "component 'audio_vae' was given two backends (audio_vae=fa and "
        "audio_vae=torch_sdpa); give it once",
        argv=(
            "explain",
            "--head-size",
            "64",
            "--dtype",
            "bf16",
            "--platform",
            "cpu",
            "--component",
            "audio_vae",
            "--attention-backend",
            "audio_vae=fa",
            "--attention-backend",
            "audio_vae=torch_sdpa",
        ),
    ),
    Case(
        "cli-component-given-twice-reversed",
        2,
        "component 'audio_vae' was given two backends (audio_vae=torch_sdpa and "
        "audio_vae=fa); give it once",
        argv=(
            "plan",
            str(Path(__file__).parents[1] / "examples" / "ltx2.toml"),
            "--platform",
            "cpu",
            "--attention-backend",
            "audio_vae=torch_sdpa",
            "--attention-backend",
            "audio_vae=fa",
        ),
    ),
    Case(
        "cli-component-backend-and-override-disagree",
        2,
        "component 'vae' was given two backends: --component-backend fa and "
        "--attention-backend vae=sage_attn; give one",
        argv=(
            "explain",
            "--head-size",
            "64",
            "--dtype",
            "bf16",
            "--platform",
            "cpu",
            "--component",
            "vae",
            "--component-backend",
            "fa",
            "--attention-backend",
            "vae=sage_attn",
        ),
    ),
    Case(
        "cli-explain-override-of-another-component",
        2,
        "--attention-backend vea=sage_attn: the component explained is 'vae', not 'vea' "
        "(did you mean 'vae'?)",
        argv=(
            "explain",
            "--head-size",
            "64",
            "--dtype",
            "bf16",
            "--platform",
            "cpu",
            "--component",
            "vae",
            "--attention-backend",
            "vea=sage_attn",
        ),
    ),
    Case(
        "cli-explain-override-without-component",
        2,
        "--attention-backend vae=fa: explain resolves this layer outside any component; "
        "give --component vae",
        argv=(
            "explain",
            "--head-size",
            "64",
            "--dtype",
            "bf16",
            "--platform",
            "cpu",
            "--attention-backend",
            "vae=fa",
        ),
    ),
    # issue 11, case 10: bounds and spelling of layer values
    Case(
        "layer-head-size-huge",
        ValueError,
        "head_size: must be at most 16384 (real layers use 32 to 576), got 1000000000",
        call=lambda: LayerSpec(head_size=10**9, dtype="bf16"),
    ),
    Case(
        "layer-head-size-bool",
        ValueError,
        "head_size: expected a positive integer, got True",
        call=lambda: LayerSpec(head_size=True, dtype="bf16"),
    ),
    Case(
        "layer-head-size-float",
        ValueError,
        "head_size: expected a positive integer, got 64.0",
        call=lambda: LayerSpec(head_size=64.0, dtype="bf16"),
    ),
    Case(
        "cli-head-size-huge",
        2,
        "head_size: must be at most 16384",
        argv=("explain", "--head-size", str(10**23), "--dtype", "bf16", "--platform", "cpu"),
    ),
    Case(
        "layer-requirement-misspelt",
        ValueError,
        "requirements: unknown requirement 'masks' (did you mean 'attn_mask'?); valid: causal",
        call=lambda: LayerSpec(head_size=64, dtype="bf16", requirements=["masks"]),
    ),
    Case(
        "cli-requirement-misspelt",
        2,
        "--requires: unknown requirement 'masks' (did you mean 'attn_mask'?)",
        argv=(
            "explain",
            "--head-size",
            "64",
            "--dtype",
            "bf16",
            "--platform",
            "cpu",
            "--requires",
            "masks",
        ),
    ),
    Case(
        "toml-requirement-misspelt",
        PipelineError,
        "layer 'mid.attn' (layers[0]): requires: unknown requirement 'casual' (did you mean "
        "'causal'?)",
        file=(".toml", _pipeline(_LAYER_OK + '\nrequires = ["casual"]')),
    ),
    Case(
        "toml-head-size-huge",
        PipelineError,
        "head_size: must be at most 16384",
        file=(".toml", _pipeline('head_size = 100000000000000000000000\ndtype = "float32"')),
    ),
    Case(
        "cli-unknown-command",
        2,
        "argument COMMAND: invalid choice: 'frobnicate'",
        argv=("frobnicate",),
    ),
    Case(
        "cli-unknown-flag",
        2,
        "unrecognized arguments: --head_size",
        argv=("explain", "--head-size", "64", "--dtype", "fp32", "--head_size", "64"),
    ),
    # -- model folders (attnres plan DIR), issue 20 ----------------------------------------
    # crashes (item 1): what a folder holds, read through the one bounded reader
    Case(
        "folder-index-nested-deeply",
        FolderBuildError,
        "model_index.json: not a valid model_index.json: nested more than 64 levels deep",
        folder=with_file("model_index.json", "[" * 100_000 + "]" * 100_000),
    ),
    Case(
        "folder-config-nested-deeply",
        FolderBuildError,
        "vae/config.json: not a valid config file: nested more than 64 levels deep",
        folder=with_file("vae/config.json", '{"a": ' + "[" * 200 + "]" * 200 + "}"),
    ),
    Case(
        "folder-header-nested-deeply",
        FolderBuildError,
        "not a safetensors file: nested more than 64 levels deep",
        folder=with_header(b"[" * 100_000 + b"]" * 100_000),
    ),
    Case(
        "folder-header-a-list",
        FolderBuildError,
        "not a safetensors file: its header is a JSON list, not an object",
        folder=with_header([1, 2]),
    ),
    Case(
        "folder-header-a-string",
        FolderBuildError,
        "not a safetensors file: its header is a JSON str, not an object",
        folder=with_header("weights"),
    ),
    Case(
        "folder-header-shape-null",
        FolderBuildError,
        "tensor 'w': shape must be a list of non-negative integers, got None",
        folder=with_header({"w": {"dtype": "F16", "shape": None}}),
    ),
    Case(
        "folder-header-shape-5",
        FolderBuildError,
        "tensor 'w': shape must be a list of non-negative integers, got 5",
        folder=with_header({"w": {"dtype": "F16", "shape": 5}}),
    ),
    Case(
        "folder-header-shape-list-of-null",
        FolderBuildError,
        "shape must be a list of non-negative integers, got [None]",
        folder=with_header({"w": {"dtype": "F16", "shape": [None]}}),
    ),
    Case(
        "folder-header-shape-string",
        FolderBuildError,
        "shape must be a list of non-negative integers, got ['x']",
        folder=with_header({"w": {"dtype": "F16", "shape": ["x"]}}),
    ),
    Case(
        "folder-header-shape-infinity",
        FolderBuildError,
        "Infinity is not valid JSON",
        folder=with_header(b'{"w": {"dtype": "F16", "shape": [Infinity]}}'),
    ),
    Case(
        "folder-header-shape-1e999",
        FolderBuildError,
        "the number 1e999 is out of range (not a finite float)",
        folder=with_header(b'{"w": {"dtype": "F16", "shape": [1e999]}}'),
    ),
    Case(
        "folder-header-integer-4301-digits",
        FolderBuildError,
        "an integer of 4301 digits (attnres reads none longer than 40)",
        folder=with_header(b'{"w": {"dtype": "F16", "shape": [' + b"9" * 4301 + b"]}}"),
    ),
    Case(
        "folder-header-longer-than-the-file",
        FolderBuildError,
        "its header claims 1000 bytes, but the file holds 10 in all",
        folder=with_file(
            "vae/diffusion_pytorch_model.safetensors", (1000).to_bytes(8, "little") + b"{}"
        ),
    ),
    Case(
        "folder-base-class-modelmixin",
        FolderBuildError,
        "component 'vae': ModelMixin is the base class of every diffusers model, not a model",
        folder=lambda root: tiny_folder(
            root, index=lambda d: d.update(vae=["diffusers", "ModelMixin"])
        ),
    ),
    Case(
        "folder-base-class-pretrainedmodel",
        FolderBuildError,
        "PreTrainedModel is the base class of every transformers model, not a model",
        folder=lambda root: tiny_folder(
            root, index=lambda d: d.update(text_encoder=["transformers", "PreTrainedModel"])
        ),
    ),
    Case(
        "folder-heads-zero",
        FolderBuildError,
        "text_encoder/config.json: num_heads: 0 is out of bounds for heads (MAX_CONFIG_HEADS): "
        "attnres plans 1 to 1024",
        folder=lambda root: tiny_folder(root, text_encoder=lambda d: d.update(num_heads=0)),
    ),
    # item 2: a FIFO is refused when opened, never waited on
    Case(
        "folder-fifo-safetensors",
        FolderBuildError,
        "diffusion_pytorch_model.safetensors: cannot read it: it is a FIFO (named pipe)",
        folder=with_special("vae/diffusion_pytorch_model.safetensors", "fifo"),
    ),
    Case(
        "folder-fifo-config",
        FolderBuildError,
        "vae/config.json: cannot read the config file: it is a FIFO (named pipe)",
        folder=with_special("vae/config.json", "fifo"),
    ),
    # item 3: config values are bounded, and the bound is named
    Case(
        "folder-num-layers-1e9",
        FolderBuildError,
        "text_encoder/config.json: num_layers: 1000000000 is out of bounds for layers "
        "(MAX_CONFIG_LAYERS): attnres plans 0 to 1024",
        folder=lambda root: tiny_folder(root, text_encoder=lambda d: d.update(num_layers=10**9)),
    ),
    Case(
        "folder-layers-per-block-2-64",
        FolderBuildError,
        "vae/config.json: layers_per_block: 18446744073709551616 is out of bounds (a config "
        "value is at most 2147483647",
        folder=lambda root: tiny_folder(root, vae=lambda d: d.update(layers_per_block=2**64)),
    ),
    Case(
        "folder-num-hidden-layers-2-64",
        FolderBuildError,
        "num_layers: 18446744073709551616 is out of bounds",
        folder=lambda root: tiny_folder(root, text_encoder=lambda d: d.update(num_layers=2**64)),
    ),
    Case(
        "folder-d-kv-zero",
        FolderBuildError,
        "d_kv: 0 is out of bounds for a head size (attnres.layer.MAX_HEAD_SIZE): attnres "
        "plans 1 to 16384",
        folder=lambda root: tiny_folder(root, text_encoder=lambda d: d.update(d_kv=0)),
    ),
    Case(
        "folder-head-size-over-the-bound",
        FolderBuildError,
        "text_encoder/config.json: d_kv: 100000 is out of bounds for a head size",
        folder=lambda root: tiny_folder(root, text_encoder=lambda d: d.update(d_kv=100000)),
    ),
    # item 16: a head size computed from the config names the component and its file
    Case(
        "folder-computed-head-size-over-the-bound",
        FolderBuildError,
        "vae/config.json: component 'vae' (AutoencoderKL): head_size: must be at most 16384",
        folder=lambda root: tiny_folder(root, vae=lambda d: d.update(block_out_channels=[32768])),
    ),
    Case(
        "folder-config-huge-integer",
        FolderBuildError,
        "vae/config.json: not a valid config file: an integer of 5000 digits",
        folder=with_file(
            "vae/config.json", '{"_class_name": "AutoencoderKL", "x": ' + "7" * 5000 + "}"
        ),
    ),
    # fuzzing: what a third-party build raises is attnres's error, naming the component
    Case(
        "folder-build-raises",
        FolderBuildError,
        "vae/config.json: cannot build AutoencoderKL for component 'vae' from this config: "
        "ValueError:",
        folder=lambda root: tiny_folder(
            root, vae=lambda d: d.update(down_block_types=["NoSuchBlock2D"])
        ),
    ),
    Case(
        "folder-build-raises-for-a-negative-size",
        FolderBuildError,
        "cannot build T5EncoderModel for component 'text_encoder' from this config: ",
        folder=lambda root: tiny_folder(root, text_encoder=lambda d: d.update(d_model=-16)),
    ),
    # item 7: a model component that cannot be planned is an error, never dropped
    Case(
        "folder-component-folder-missing",
        FolderBuildError,
        "vae/config.json: cannot read the config file: No such file or directory",
        folder=with_special("vae", "missing"),
    ),
    Case(
        "folder-component-config-missing",
        FolderBuildError,
        "text_encoder/config.json: cannot read the config file: No such file or directory",
        folder=with_special("text_encoder/config.json", "missing"),
    ),
    Case(
        "folder-component-config-a-directory",
        FolderBuildError,
        "vae/config.json: cannot read the config file: it is a directory",
        folder=with_special("vae/config.json", "dir"),
    ),
    Case(
        "folder-component-config-dangling-symlink",
        FolderBuildError,
        "vae/config.json: cannot read the config file: a symlink to 'gone', which does not exist",
        folder=with_special("vae/config.json", "dangling"),
    ),
    Case(
        "folder-component-folder-symlink-loop",
        FolderBuildError,
        "vae/config.json: cannot read the config file: ",
        folder=with_special("vae", "loop"),
    ),
    Case(
        "folder-index-entry-malformed",
        FolderBuildError,
        "model_index.json: 'vae': expected [LIBRARY, CLASS] (two strings, or [null, null] for "
        'an absent component), got ["diffusers"]',
        folder=lambda root: tiny_folder(root, index=lambda d: d.update(vae=["diffusers"])),
    ),
    Case(
        "folder-index-entry-not-strings",
        FolderBuildError,
        "expected [LIBRARY, CLASS] (two strings, or [null, null] for an absent component), "
        "got [1, 2]",
        folder=lambda root: tiny_folder(root, index=lambda d: d.update(vae=[1, 2])),
    ),
    Case(
        "folder-index-empty",
        FolderBuildError,
        "model_index.json: no model component to plan",
        folder=with_file("model_index.json", "{}"),
    ),
    Case(
        "folder-index-not-an-object",
        FolderBuildError,
        "model_index.json: not a valid model_index.json: expected a JSON object, got a list",
        folder=with_file("model_index.json", "[]"),
    ),
    Case(
        "folder-unknown-class",
        FolderBuildError,
        "component 'vae': diffusers has no class 'AutoencoderKLL'",
        folder=lambda root: tiny_folder(
            root, index=lambda d: d.update(vae=["diffusers", "AutoencoderKLL"])
        ),
    ),
    Case(
        "folder-class-name-not-a-name",
        FolderBuildError,
        "component 'vae': '__class__' is not a class name",
        folder=lambda root: tiny_folder(
            root, index=lambda d: d.update(vae=["diffusers", "__class__"])
        ),
    ),
    # a component key is a name, never a path
    Case(
        "folder-key-escapes-the-folder",
        FolderBuildError,
        "model_index.json: '../outside' is not a component name",
        folder=lambda root: tiny_folder(
            root, index=lambda d: d.update({"../outside": ["diffusers", "AutoencoderKL"]})
        ),
    ),
    Case(
        "folder-key-300-characters",
        FolderBuildError,
        "is not a component name (letters, digits, '_', '-', '.', at most 100 characters",
        folder=lambda root: tiny_folder(
            root, index=lambda d: d.update({"k" * 300: ["diffusers", "AutoencoderKL"]})
        ),
    ),
    Case(
        "folder-key-absolute-path",
        FolderBuildError,
        "model_index.json: '/etc' is not a component name",
        folder=lambda root: tiny_folder(
            root, index=lambda d: d.update({"/etc": ["diffusers", "AutoencoderKL"]})
        ),
    ),
    # item 16: a single model folder that is neither kind says both
    Case(
        "folder-config-neither-kind",
        FolderBuildError,
        "neither a transformers model config (no 'architectures' entry naming the model "
        "class) nor a diffusers model config",
        folder=lambda root: (root.mkdir(), (root / "config.json").write_text("{}"), root)[2],
    ),
    # item 18: --dtype conflicts are usage errors; names normalised
    Case(
        "cli-dtype-component-twice",
        2,
        "--dtype: component 'vae' was given two dtypes (vae=float16 and vae=float32); give it once",
        argv=(
            "plan",
            str(Path(__file__).parents[1] / "examples" / "flux.1-dev"),
            "--dtype",
            "vae=fp16",
            "--dtype",
            "VAE=fp32",
        ),
    ),
    Case(
        "cli-dtype-global-twice",
        2,
        "--dtype: the dtype for every component was given twice (float16 and bfloat16)",
        argv=(
            "plan",
            str(Path(__file__).parents[1] / "examples" / "flux.1-dev"),
            "--dtype",
            "fp16",
            "--dtype",
            "bf16",
        ),
    ),
    # issue 21: the flags a folder refuses, in the one error format (FILE: WHERE: MESSAGE)
    Case(
        "cli-component-on-a-pipeline-folder",
        2,
        "flux.1-dev: --component vae: it is a pipeline folder, whose model_index.json names "
        "its components",
        argv=(
            "plan",
            str(Path(__file__).parents[1] / "examples" / "flux.1-dev"),
            "--platform",
            "cpu",
            "--component",
            "vae",
        ),
    ),
    Case(
        "cli-dtype-for-a-component-the-folder-lacks",
        2,
        "flux.1-dev: --dtype vea=...: no model component 'vea'; its components: text_encoder, "
        "text_encoder_2, transformer, vae",
        argv=(
            "plan",
            str(Path(__file__).parents[1] / "examples" / "flux.1-dev"),
            "--platform",
            "cpu",
            "--dtype",
            "vea=fp16",
        ),
    ),
    Case(
        "cli-plan-dir-trace-out-under-a-file",
        2,
        "test_bad_inputs.py/traces': not a directory: '",
        argv=(
            "plan",
            str(Path(__file__).parents[1] / "examples" / "flux.1-dev"),
            "--platform",
            "cpu",
            "--trace-out",
            str(Path(__file__) / "traces"),
        ),
    ),
    Case(
        "cli-component-on-a-pipeline-file",
        2,
        "--component names the component of a single model folder",
        argv=(
            "plan",
            str(Path(__file__).parents[1] / "examples" / "cpu-small.toml"),
            "--component",
            "vae",
        ),
    ),
    # -- autotune results files, issue 20 (items 2, 14 and fuzzing) ----------------------
    Case(
        "results-negative-median",
        ResultsFileError,
        "$.entries[0].measurements[1].median_ns: -5 is impossible (expected 0 to",
        call=lambda: _results(lambda e: e["measurements"][1].update(median_ns=-5)),
    ),
    Case(
        "results-zero-repeats",
        ResultsFileError,
        "$.entries[0].repeats: 0 is impossible (expected 1 to",
        call=lambda: _results(lambda e: e.update(repeats=0)),
    ),
    Case(
        "results-duplicate-candidate",
        ResultsFileError,
        "candidate 'eager' appears twice (in measurements or no_kernel)",
        call=lambda: _results(lambda e: e["measurements"].append(e["measurements"][1])),
    ),
    Case(
        "results-candidate-measured-and-without-kernel",
        ResultsFileError,
        "candidate 'eager' appears twice",
        call=lambda: _results(lambda e: e.update(no_kernel={"eager": "none here"})),
    ),
    Case(
        "results-incumbent-not-first",
        ResultsFileError,
        "measurements[0]: 'eager' is not the incumbent 'torch_sdpa'",
        call=lambda: _results(lambda e: e["measurements"].reverse()),
    ),
    Case(
        "results-negative-deviation",
        ResultsFileError,
        "measurements[1].deviation: -0.5 is impossible",
        call=lambda: _results(lambda e: e["measurements"][1].update(deviation=-0.5)),
    ),
    Case(
        "results-deviation-10-400",
        ResultsFileError,
        "not an attnres autotune results file (an integer of 401 digits",
        call=lambda: _results(lambda e: e["measurements"][1].update(deviation=10**400)),
    ),
    Case(
        "results-a-fifo",
        ResultsFileError,
        "cannot read the autotune results: it is a FIFO (named pipe)",
        call=lambda: _results_special("fifo"),
    ),
    Case(
        "results-save-to-a-fifo",
        ResultsFileError,
        "cannot read the autotune results: it is a FIFO (named pipe)",
        call=lambda: _results_special("fifo", save=True),
    ),
]


def _results_doc(edit: Callable[[dict[str, Any]], object]) -> dict[str, Any]:
    from attnres.tuning import Measured, ResultEntry

    sdpa, eager = Backend.parse("torch_sdpa"), Backend.parse("eager")
    entry = ResultEntry(
        platform={"kind": "cpu"},
        call="q(1, 64, 8, 64)",
        incumbent=sdpa,
        measured=(Measured(sdpa, 1000, 10), Measured(eager, 900, 10, 0.0)),
        no_kernel=(),
        warmup=1,
        repeats=3,
    ).to_json()
    edit(entry)
    return {"format": "attnres-autotune-results", "version": 1, "entries": [entry]}


def _results(edit: Callable[[dict[str, Any]], object]) -> object:
    from attnres.autotuner import load_results

    path = Path("results.json")
    path.write_text(json.dumps(_results_doc(edit)))
    return load_results(path, platform=CPU)


def _results_special(kind: str, save: bool = False) -> object:
    import os

    from attnres.autotuner import load_results, save_results

    path = Path("results.json")
    assert kind == "fifo"
    os.mkfifo(path)
    return save_results(path) if save else load_results(path, platform=CPU)


def _one_paragraph(text: str) -> str:
    return " ".join(text.split())


def _run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's usage errors
        code = exc.code if isinstance(exc.code, int) else 2
    out, err = capsys.readouterr()
    return code, out, err


def _check_cli(
    argv: list[str], expected: int, fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _run_cli(argv, capsys)
    assert code == expected, (argv, code, err)
    assert "Traceback" not in err
    if argv[0] == "replay" and out:
        # replay's own output is one status line per file; the error is on stderr
        assert out == f"ERR  {argv[1]}\n", out
    else:
        assert out == "", out
    assert fragment in _one_paragraph(err), err
    # one paragraph: argparse's usage lines, then the message; no blank line inside
    assert "\n\n" not in err.strip()


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(
    case: Case, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # relative paths in messages and argv stay short
    assert sum(x is not None for x in (case.call, case.argv, case.file, case.folder)) == 1, case.id
    if case.folder is not None:
        assert isinstance(case.expected, type)
        from attnres.integrations import plan_folder

        folder = case.folder(Path("pipe"))
        with pytest.raises(BaseException) as info:
            plan_folder(folder, platform=CPU)
        assert type(info.value) is case.expected, repr(info.value)
        assert case.fragment in _one_paragraph(str(info.value)), str(info.value)
        _check_cli(["plan", str(folder), "--platform", "cpu"], 2, case.fragment, capsys)
        return
    if case.argv is not None:
        assert isinstance(case.expected, int)
        _check_cli(list(case.argv), case.expected, case.fragment, capsys)
        return
    assert isinstance(case.expected, type)
    if case.call is not None:
        with pytest.raises(BaseException) as info:
            case.call()
        assert type(info.value) is case.expected, repr(info.value)
        assert case.fragment in str(info.value), str(info.value)
        return
    assert case.file is not None
    suffix, content = case.file
    path = Path("input" + suffix)
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    loader = load_pipeline if suffix == ".toml" else load_trace
    with pytest.raises(BaseException) as info:
        loader(path)
    assert type(info.value) is case.expected, repr(info.value)
    assert case.fragment in str(info.value), str(info.value)
    # the command that reads this kind of file: exit 2, the same message
    argv = ["plan", str(path), "--platform", "cpu"] if suffix == ".toml" else ["replay", str(path)]
    _check_cli(argv, 2, case.fragment, capsys)


def test_every_input_error_is_a_value_error() -> None:
    """The catalogue's library errors about inputs are ValueErrors (SPEC 3.5, 5)."""
    for cls in (
        UnknownBackendError,
        ResolutionError,
        BackendNotAppliedError,
        TraceFormatError,
        PipelineError,
        PluginError,
        FolderBuildError,
        ResultsFileError,
    ):
        assert issubclass(cls, ValueError), cls
    assert issubclass(attnres.ConsensusError, RuntimeError)
    assert issubclass(KernelNotRegisteredError, RuntimeError)
    expected = {c.expected for c in CASES if isinstance(c.expected, type)}
    assert expected <= {
        ValueError,
        TypeError,
        UnknownBackendError,
        ResolutionError,
        BackendNotAppliedError,
        TraceFormatError,
        PipelineError,
        PluginError,
        KernelNotRegisteredError,
        FolderBuildError,
        ResultsFileError,
    }


def test_the_catalogue_is_documented() -> None:
    """docs/errors.md names every error type the catalogue expects."""
    text = (Path(__file__).parents[1] / "docs" / "errors.md").read_text(encoding="utf-8")
    for cls in {c.expected for c in CASES if isinstance(c.expected, type)}:
        assert f"`{cls.__name__}`" in text, cls.__name__
    from attnres._states import Code

    for code in Code:
        assert f"`{code.value}`" in text, code.value


@pytest.mark.parametrize("make", [int, "numpy", "torch"])
def test_any_index_integer_is_a_head_size(make: Any) -> None:
    """Issue 11, case 10: numpy and torch integers work as head sizes (``__index__``)."""
    if make == "numpy":
        import numpy as np

        value: Any = np.int64(64)
    elif make == "torch":
        value = torch.tensor(64)
    else:
        value = 64
    layer = LayerSpec(head_size=value, dtype="bf16")
    assert layer.head_size == 64 and type(layer.head_size) is int
    assert resolve(layer, platform=CPU).backend == Backend.parse("torch_sdpa")
    module = Attention(num_heads=value, head_size=value, dtype="float32", platform=CPU)
    assert module.head_size == 64 and type(module.head_size) is int
