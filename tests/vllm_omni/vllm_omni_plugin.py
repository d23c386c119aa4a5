"""Loaded by ``make test-vllm-omni`` as a pytest plugin (``-p vllm_omni_plugin``),
never by ``make test``.

``ATTNRES_VLLM_OMNI_PLUGIN=1`` loads vLLM-Omni's general plugins through its
own lifecycle (``vllm_omni.plugins.load_omni_general_plugins()``, what its
workers call before the model is built) before the first test, so the attnres
plugin, discovered through its entry point in ``vllm_omni.general_plugins``,
decides every ``get_attn_backend_for_role`` call of the session. At the end it
reports what the plugin decided and what it left to vLLM-Omni, checks that
every decision is in ``attnres.decisions()`` and replays, and that
``uninstall()`` restored vLLM-Omni's selector everywhere.
"""

from __future__ import annotations

import os
import sys
import types
from typing import Any

_VERDICT: list[str] = []


def _on() -> bool:
    return os.environ.get("ATTNRES_VLLM_OMNI_PLUGIN") == "1"


def pytest_report_header(config: Any) -> str:
    return f"attnres vLLM-Omni plugin: {'on' if _on() else 'off'}"


def pytest_configure(config: Any) -> None:
    if not _on():
        return
    from vllm_omni.plugins import load_omni_general_plugins

    load_omni_general_plugins()
    from attnres.integrations import vllm_omni as plugin

    if not plugin.installed():
        raise RuntimeError("the attnres vLLM-Omni plugin did not take over the selector")


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    if not _on():
        return
    import attnres
    from attnres.integrations import vllm_omni as plugin

    decisions = attnres.decisions()
    replayed = sum(bool(attnres.replay(d.trace)) for d in decisions)
    stats = plugin.stats()
    _VERDICT.append(
        f"attnres plugin: {stats['decided']} selector calls decided by attnres, "
        f"{stats['delegated']} answered by vLLM-Omni (a backend name or class attnres has "
        f"no backend for); {len(decisions)} in attnres.decisions(), {replayed} replay "
        f"identically; installed at the end: {plugin.installed()}"
    )
    plugin.uninstall()
    stale = [
        f"{m.__name__}.{name}"
        for m in list(sys.modules.values())
        if isinstance(m, types.ModuleType)
        for name, value in list(vars(m).items())
        if callable(value) and plugin._ours(value) is not None
    ]
    restored = not plugin.installed() and not stale
    _VERDICT.append(f"attnres plugin: uninstall() restored vLLM-Omni's selector: {restored}")
    if (len(decisions) != stats["decided"] or replayed != len(decisions) or not restored) and (
        session.exitstatus == 0
    ):
        session.exitstatus = 1
        _VERDICT.append("attnres plugin: FAILED (a decision was not recorded or does not replay)")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    for line in _VERDICT:
        terminalreporter.write_line(line)
