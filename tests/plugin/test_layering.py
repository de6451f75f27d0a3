"""The layering of docs/architecture.md: policies/ and paging/ import no vLLM; only kvpolicy.vllm does.

The Triton kernels and the C++ ops stand alone.
"""

import ast
import subprocess
import sys
from pathlib import Path


def _modules_after(imports: str) -> set[str]:
    code = f"import sys, {imports}; print('\\n'.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_pure_layers_do_not_import_vllm():
    loaded = _modules_after(
        "kvpolicy, kvpolicy.config, kvpolicy.policies, kvpolicy.paging, kvpolicy.offline.model, kvpolicy.offline.calibrate, kvpolicy.offline.calibrate_pod, kvpolicy.offline.train_pod"
    )
    assert not any(m == "vllm" or m.startswith("vllm.") for m in loaded)


def test_kernels_import_neither_vllm_nor_kvpolicy():
    for package in ("kvpolicy_triton", "kvpolicy_csrc"):
        loaded = _modules_after(package)
        assert not any(m.split(".")[0] in ("vllm", "kvpolicy") for m in loaded), package


def _import_graph(package: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports anywhere in its text (at the top, in a function, under
    ``TYPE_CHECKING``): a name imported from a package counts as its submodule when it is one."""
    modules = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = name.split(".")[: len(name.split(".")) - node.level + is_package]
                    base = ".".join([*anchor, *([base] if base else [])])
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names
                ]
            else:
                continue
            graph[name].update(target for target in targets if target in modules and target != name)
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_module_of_kvpolicy_imports_itself_back_through_others():
    graph = _import_graph(Path(__file__).resolve().parents[2] / "kvpolicy")
    assert "kvpolicy.vllm.worker.modes.relocate" in graph["kvpolicy.vllm.worker.modes"]  # the graph is read
    assert _circles(graph) == []


def test_the_circle_finder_finds_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


#: kvpolicy.vllm's packages by process, and the packages each may import: start-up names the scheduler's and
#: the worker's classes to vLLM, the scheduler asks the worker's modes what a step may rewrite, the worker
#: stands alone; the modules beside them (internals, patches, messages, metrics) serve all three.
PROCESS_PACKAGES = {
    "kvpolicy.vllm.startup": {"kvpolicy.vllm.scheduler", "kvpolicy.vllm.worker"},
    "kvpolicy.vllm.scheduler": {"kvpolicy.vllm.worker"},
    "kvpolicy.vllm.worker": set(),
    "": set(),  # kvpolicy.vllm's own modules
}


def _process_package(module: str) -> str | None:
    """The process package a module of kvpolicy.vllm sits in ("" for the shared modules); None outside."""
    for package in PROCESS_PACKAGES:
        if package and (module == package or module.startswith(package + ".")):
            return package
    return "" if module.startswith("kvpolicy.vllm") else None


def test_each_process_package_imports_only_those_below_it():
    graph = _import_graph(Path(__file__).resolve().parents[2] / "kvpolicy")
    assert "kvpolicy.vllm.worker.modes.relocate" in graph  # the packages exist
    crossings = set()
    for module, targets in graph.items():
        source = _process_package(module)
        if source is None or module == "kvpolicy.vllm":  # the package itself registers the plugin
            continue
        for target in targets:
            package = _process_package(target)
            if package not in (None, "", source) and package not in PROCESS_PACKAGES[source]:
                crossings.add((module, target))
    assert crossings == set()
