"""Every exception attnres raises on purpose lives in ``attnres.errors`` under one base."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import attnres
from attnres import errors


def _attnres_modules() -> list[str]:
    return [
        info.name
        for info in pkgutil.walk_packages(attnres.__path__, "attnres.")
        if info.name != "attnres.__main__"
    ]


def test_every_public_exception_class_is_defined_in_attnres_errors() -> None:
    elsewhere = []
    for name in _attnres_modules():
        module = importlib.import_module(name)
        for attr, obj in vars(module).items():
            if (
                inspect.isclass(obj)
                and issubclass(obj, BaseException)
                and obj.__module__.startswith("attnres")
                and not attr.startswith("_")
                and obj.__module__ != "attnres.errors"
            ):
                elsewhere.append(f"{obj.__module__}.{attr}")
    assert elsewhere == []


def test_every_exception_in_attnres_errors_has_the_one_base() -> None:
    exceptions = [getattr(errors, name) for name in errors.__all__]
    assert all(issubclass(e, errors.AttnresError) for e in exceptions)
    # each keeps the built-in base of its kind, so existing except clauses hold
    assert issubclass(errors.ResolutionError, ValueError)
    assert issubclass(errors.KernelUnavailableError, ImportError)
    assert issubclass(errors.KernelNotRegisteredError, RuntimeError)
    assert issubclass(errors.TraceWriteError, OSError)


def test_old_homes_re_export_the_same_classes() -> None:
    from attnres.integrations._plan import IntegrationError
    from attnres.kernels import KernelUnavailableError
    from attnres.modules import KernelNotRegisteredError
    from attnres.plan import PipelineError
    from attnres.request import RequestBackendError

    assert IntegrationError is errors.IntegrationError
    assert KernelUnavailableError is errors.KernelUnavailableError
    assert KernelNotRegisteredError is errors.KernelNotRegisteredError
    assert PipelineError is errors.PipelineError
    assert RequestBackendError is errors.RequestBackendError


def test_all_and_dir_list_the_lazy_names_and_each_resolves() -> None:
    for name in ("kernels", "distributed", "Attention", "bind", "request_backend", "autotune",
                 "replay", "ReplayResult", "AttnresError"):
        assert name in attnres.__all__
    assert set(attnres.__all__) <= set(dir(attnres))
    for name in attnres.__all__:
        assert getattr(attnres, name) is not None
