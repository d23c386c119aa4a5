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

Every call the tests make is checked as it returns (issue 36): a spy around the
plugin's selector (in the selector module, where the tests call it; their
files are not edited) finds, in ``attnres.decisions()``, the decision for that
call -- the role as the layer's name, the head size, and the answer: the
backend of the class returned, or a rejection for a call that raised. A call
with no such decision, or one vLLM-Omni answered itself, fails the session.
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
    _spy()


#: (calls the spy saw, calls whose decision was found, what was missing)
_CHECKED: list[Any] = [0, 0, []]


def _spy() -> None:
    """Wrap the plugin's selector in the selector module: each call's decision
    must be in ``attnres.decisions()`` when it returns."""
    import functools

    import vllm_omni.diffusion.attention.selector as selector

    import attnres
    from attnres.integrations import vllm_omni as plugin

    routed = selector.get_attn_backend_for_role

    def find(role: Any, head_size: Any, served: str | None) -> bool:
        for decision in reversed(attnres.decisions()):
            layer = decision.trace.input.layer
            if layer.name != str(role) or layer.head_size != head_size:
                continue
            backend = decision.outcome.backend
            if (served is None and backend is None) or (
                backend is not None and served is not None and backend.name == served
            ):
                return True
        return False

    @functools.wraps(routed)
    def spied(role: Any, head_size: Any, *args: Any, **kwargs: Any) -> Any:
        delegated = plugin.stats()["delegated"]
        _CHECKED[0] += 1
        try:
            answer = routed(role, head_size, *args, **kwargs)
        except Exception:
            served = None
            raise
        else:
            served = str(answer[0].get_name()).lower()
            return answer
        finally:
            found = plugin.stats()["delegated"] == delegated and find(role, head_size, served)
            if found:
                _CHECKED[1] += 1
            else:
                _CHECKED[2].append(f"{role!r}, head size {head_size} -> {served}")

    selector.get_attn_backend_for_role = spied


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    if not _on():
        return
    import attnres
    from attnres.integrations import vllm_omni as plugin

    decisions = attnres.decisions()
    replayed = sum(bool(attnres.replay(d.trace)) for d in decisions)
    stats = plugin.stats()
    _VERDICT.append(
        f"attnres plugin: {stats['decided']} decisions made by attnres, "
        f"{stats['delegated']} calls answered by vLLM-Omni itself; {len(decisions)} in "
        f"attnres.decisions(), {replayed} replay identically; backends registered on first "
        f"sight: {', '.join(sorted(plugin.seen_backends())) or 'none'}; installed at the "
        f"end: {plugin.installed()}"
    )
    _VERDICT.append(
        f"attnres plugin: {_CHECKED[1]} of the {_CHECKED[0]} selector calls the tests made "
        "found their decision in attnres.decisions() as they returned"
        + "".join(f"\n  missing: {m}" for m in _CHECKED[2])
    )
    import vllm_omni.diffusion.attention.selector as selector

    selector.get_attn_backend_for_role = selector.get_attn_backend_for_role.__wrapped__
    plugin.uninstall()
    stale = [
        f"{m.__name__}.{name}"
        for m in list(sys.modules.values())
        if isinstance(m, types.ModuleType)
        for name, value in list(vars(m).items())
        if callable(value) and plugin._TAKEOVER.original(value) is not None
    ]
    restored = not plugin.installed() and not stale
    _VERDICT.append(f"attnres plugin: uninstall() restored vLLM-Omni's selector: {restored}")
    checked = _CHECKED[0] > 0 and _CHECKED[1] == _CHECKED[0] and not stats["delegated"]
    if (
        len(decisions) != stats["decided"] or replayed != len(decisions) or not restored
    ) or not checked:
        session.exitstatus = 1
        _VERDICT.append("attnres plugin: FAILED (a decision was not recorded or does not replay)")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    for line in _VERDICT:
        terminalreporter.write_line(line)
