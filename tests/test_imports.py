"""The import graph of ``src/attnres``: no cycles, and no lazy import that hides one.

Every import statement counts, ``if TYPE_CHECKING:`` ones included (issue 33
item 5: a type-only import is still a dependency, and a circle of them says two
floors know each other). Annotations that are only strings
(``from __future__ import annotations``) name no module and do not count.

An import inside a function is allowed only where it keeps ``import attnres``
light (torch, the layer, the kernels, optional packages) or is a documented
entry point; each such import is listed in ``LAZY`` with its reason. Any other
function-level import of an attnres module is a failure: it is usually a cycle
dodged at run time, which this test would otherwise not see.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "attnres"

#: (module, imported attnres module) -> why the import is inside a function
LAZY: dict[tuple[str, str], str] = {
    ("attnres", "attnres.modules"): "Attention imports torch: loaded on first use",
    ("attnres", "attnres.replayer"): "exported lazily, like the layer",
    ("attnres", "attnres.parallel"): "SequenceParallel imports torch: loaded on first use",
    ("attnres", "attnres.request"): "request_backend imports torch: loaded on first use",
    ("attnres", "attnres.autotuner"): "measured selection imports torch: loaded on first use",
    ("attnres", "attnres.schedules"): "schedule imports torch: loaded on first use (issue 23)",
    ("attnres.cli", "attnres.plan"): "plan is loaded only by the commands that use it",
    ("attnres.cli", "attnres.integrations._folder"): (
        "folder planning is loaded only by the command that uses it"
    ),
    ("attnres.integrations._folder", "attnres.integrations.diffusers"): (
        "imports the optional diffusers package, only for a diffusers folder"
    ),
    ("attnres.integrations._folder", "attnres.integrations.transformers"): (
        "imports the optional transformers package"
    ),
    ("attnres.kernels.lse", "attnres.kernels.fa"): (
        "the resolver imports the lse registry; the fa adapter module loads with its adapter"
    ),
    ("attnres.kernels.lse", "attnres.kernels.sage_attn"): (
        "the resolver imports the lse registry; the sage adapter module loads with its adapter"
    ),
    ("attnres.kernels.torch_cudnn_sdpa", "attnres.kernels.torch_sdpa"): (
        "torch_sdpa imports torch; adapters import their kernel in make_kernel()"
    ),
    ("attnres.kernels.dynamic_cudnn_sdpa", "attnres.kernels.torch_sdpa"): (
        "torch_sdpa imports torch; adapters import their kernel in make_kernel()"
    ),
    # issue 34
    ("attnres.cli", "attnres.precision"): (
        "calibrate imports torch: loaded only by the command that uses it"
    ),
    ("attnres.precision", "attnres.integrations.diffusers"): (
        "imports the optional diffusers package, only for calibrate_pipeline"
    ),
}


#: Import cycles tolerated for now: none. (The two the integrations brought
#: are gone: a plan renders itself (attnres.plan.render_plan, which the CLI uses too), and
#: the helpers both integrations share live in integrations._plan.)
KNOWN_CYCLES: tuple[frozenset[str], ...] = ()


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _targets(module: str, node: ast.AST, is_package: bool, modules: set[str]) -> list[str]:
    out: list[str] = []
    if isinstance(node, ast.Import):
        out = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
        base = _resolve(module, node, is_package)
        subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
        # ``from attnres import machine`` imports the submodule; a name that is
        # not a submodule comes from the package itself
        out = subs + ([base] if len(subs) < len(node.names) else [])
    return [t for t in out if t == "attnres" or t.startswith("attnres.")]


def _graph() -> tuple[dict[str, set[str]], dict[tuple[str, str], int]]:
    files = {_module_name(p): p for p in SRC.rglob("*.py")}
    modules = set(files)
    top: dict[str, set[str]] = {m: set() for m in modules}
    lazy: dict[tuple[str, str], int] = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        is_package = path.name == "__init__.py"

        def visit(node: ast.AST, in_function: bool, module: str = module,
                  is_package: bool = is_package) -> None:  # fmt: skip
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    for target in _targets(module, child, is_package, modules):
                        own = target == module or target.startswith(module + ".")
                        if own and not in_function:
                            continue  # a package importing its own submodules
                        if module.startswith(target + "."):
                            continue  # a submodule naming its own package (loaded already)
                        if in_function:
                            lazy[(module, target)] = child.lineno
                        else:
                            top[module].add(target)
                inner = in_function or isinstance(
                    child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
                )
                visit(child, inner)

        visit(tree, False)
    # importing ``attnres.x`` runs ``attnres/__init__`` first: not an edge worth
    # reporting (the root package re-exports on purpose)
    for deps in top.values():
        deps.discard("attnres")
    return top, lazy


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def walk(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                found.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                walk(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            walk(node)
    return found


def test_no_import_cycle_inside_attnres() -> None:
    graph, lazy = _graph()
    # a lazy import counts too: hiding an edge in a function does not remove it
    for module, target in lazy:
        graph[module] = graph[module] | {target}
    graph_cycles = [
        c for c in _cycles(graph) if "attnres" not in c and frozenset(c) not in KNOWN_CYCLES
    ]
    assert graph_cycles == [], " ; ".join(" -> ".join(c) for c in graph_cycles)


def test_function_level_imports_are_only_the_documented_lazy_ones() -> None:
    _, lazy = _graph()
    unexplained = sorted(
        f"{module} imports {target} inside a function (line {line})"
        for (module, target), line in lazy.items()
        if (module, target) not in LAZY
    )
    assert unexplained == [], "\n".join(unexplained)
    stale = sorted(set(LAZY) - set(lazy))
    assert stale == [], f"LAZY lists imports that no longer exist: {stale}"


def test_type_checking_imports_are_edges() -> None:
    """The ledger imports ``Trace`` for its annotations only (``if TYPE_CHECKING:``,
    its one import of attnres.trace): the graph still has the edge."""
    graph, lazy = _graph()
    assert "attnres.trace" in graph["attnres.ledger"]
    assert ("attnres.ledger", "attnres.trace") not in lazy


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c", "a"]]


def test_layer_does_not_import_the_cli() -> None:
    graph, lazy = _graph()
    assert "attnres.cli" not in graph["attnres.layer"]
    assert not any(m == "attnres.layer" and t == "attnres.cli" for m, t in lazy)


def test_the_floor_knows_nothing_above_it() -> None:
    """Issue 33 item 5: the lowest modules import nothing of attnres above them,
    not even for a type: the state names import no attnres module, the errors
    only the state names (what an error carries from above is annotated ``Any``
    there), and the vocabulary only the errors it raises."""
    graph, lazy = _graph()
    assert graph["attnres._states"] == set()
    assert graph["attnres.errors"] == {"attnres._states"}
    assert graph["attnres._vocab"] <= {"attnres.errors"}
    assert not any(m in ("attnres._states", "attnres._vocab", "attnres.errors") for m, _ in lazy)
