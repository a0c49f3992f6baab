"""The package layering: which specserve package may import which, no cycles, small files.

Every import counts, including those inside functions and under TYPE_CHECKING: a lazy import is
still a dependency. A package's own modules may import each other, but not in a circle: between
the files of the core (everything but bench/ and train/) there is no import cycle either. A
top-level module (args.py, cli.py, ...) is a package of its own. The mutation tests plant a
back-edge and cycles in a copy of the source tree and check that the checker reports them.
"""

from __future__ import annotations

import ast
import os
import shutil
from collections import defaultdict

import pytest

import specserve

SOURCE = os.path.dirname(os.path.abspath(specserve.__file__))
MAX_LINES = 600  # one responsibility per file, not a line cap: a file may grow to this where one needs it
MAX_FUNCTION_LINES = 60  # in the core packages (bench/ and train/ are scripts, not the engine)
NOT_CORE = ("bench", "train")
FORBIDDEN_PACKAGE_NAMES = {"spec", "dist", "io"}

# Lower layers first; each package lists every package it may import.
ALLOWED: dict[str, set[str]] = {
    "assets": set(),
    "envs": {"errors"},
    "names": set(),
    "errors": set(),
    "sampling_params": {"errors"},
    "paths": {"errors"},
    "drafters": {"names", "errors"},  # declarations only (no torch): the flag checks read them
    "args_checks": {"names", "drafters", "errors", "paths"},
    "args": {"names", "drafters", "assets", "envs", "errors", "paths", "args_checks"},
    "datasets": {"errors"},
    "sampler": {"sampling_params", "runtime"},
    "logits": {"sampling_params", "runtime", "errors"},
    "runtime": {"envs", "errors"},
    "kernels": {"envs", "errors"},
    "distributed": {"args", "envs", "errors"},
    "kv": {"runtime", "distributed", "errors"},
    "models": {"kernels", "kv", "runtime", "sampler", "sampling_params", "errors"},
    "tokenizer": {"models", "errors"},
    "speculative": {"names", "drafters", "models", "kv", "sampler", "sampling_params", "runtime", "errors"},
    "executor": {"names", "drafters", "speculative", "models", "kv", "runtime", "distributed", "sampler", "sampling_params", "logits",
                 "errors"},
    "scheduler": {"names", "executor", "kv", "sampling_params", "errors", "logits"},
    "engine": {"args_checks", "names", "drafters", "scheduler", "executor", "speculative", "models", "kv", "runtime", "distributed", "tokenizer",
               "sampler", "sampling_params", "args", "envs", "errors", "logits"},
    "server": {"names", "drafters", "engine", "tokenizer", "models", "sampling_params", "args", "errors", "logits"},
    "train": {"names", "engine", "models", "kv", "tokenizer", "datasets", "sampler", "sampling_params", "args", "assets",
              "kernels", "errors"},
    "bench": {"args_checks", "names", "engine", "scheduler", "executor", "speculative", "models", "kernels", "kv", "tokenizer", "datasets", "args",
              "sampling_params", "logits", "envs", "errors"},
    "flag_bounds": {"args_checks", "server", "errors"},  # the heartbeat bound is the server's interval
    "cli": {"names", "args", "args_checks", "bench", "engine", "models", "sampling_params", "server", "train", "errors", "flag_bounds"},
    "(root)": {"engine", "sampling_params"},  # specserve/__init__.py: the public names
}
# The layer the issue names explicitly: models/ holds nn.Modules and what they read, nothing above.
MODELS_MUST_NOT_IMPORT = {"scheduler", "executor", "speculative", "server", "engine"}


def package_of(source: str, path: str) -> str:
    rel = os.path.relpath(path, source)
    parts = rel[:-3].split(os.sep)
    if len(parts) == 1:
        return "(root)" if parts[0] == "__init__" else parts[0]
    return parts[0]


def imported_packages(node: ast.AST) -> list[str]:
    """specserve packages named by one import statement."""
    if isinstance(node, ast.Import):
        return [a.name.split(".")[1] for a in node.names if a.name.startswith("specserve.")]
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        if node.module == "specserve":  # from specserve import envs
            return [a.name for a in node.names]
        if node.module.startswith("specserve."):
            return [node.module.split(".")[1]]
    return []


def import_graph(source: str) -> dict[str, dict[str, list[str]]]:
    """package -> imported package -> the files that import it."""
    graph: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for folder, _, files in os.walk(source):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            src = package_of(source, path)
            with open(path) as f:
                tree = ast.parse(f.read(), path)
            for node in ast.walk(tree):
                for dst in imported_packages(node):
                    if dst != src:
                        graph[src][dst].append(os.path.relpath(path, source))
    return graph


def find_cycle(graph: dict[str, dict[str, list[str]]]) -> list[str]:
    """One package cycle, or [] (depth-first search over the package graph)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, {})):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return []


def layering_violations(source: str) -> list[str]:
    graph = import_graph(source)
    problems = []
    for src, targets in sorted(graph.items()):
        for dst, files in sorted(targets.items()):
            if src == "models" and dst in MODELS_MUST_NOT_IMPORT:
                problems.append(f"models imports {dst} ({', '.join(files)})")
            elif src not in ALLOWED:
                problems.append(f"package {src} has no entry in the layering table")
            elif dst not in ALLOWED[src]:
                problems.append(f"{src} -> {dst} is not an allowed arrow ({', '.join(files)})")
    cycle = find_cycle(graph)
    if cycle:
        problems.append("import cycle: " + " -> ".join(cycle))
    return problems


def _module_files(source: str) -> dict[str, str]:
    """Dotted module name -> file relative to `source` (a package is its __init__.py)."""
    files = {}
    for folder, _, names in os.walk(source):
        for name in (n for n in names if n.endswith(".py")):
            rel = os.path.relpath(os.path.join(folder, name), source)
            parts = ["specserve", *rel[:-3].split(os.sep)]
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = rel
    return files


def _imported_modules(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """Dotted names one import statement loads: `import a.b` gives a.b; `from m import x` gives
    m.x (a submodule, or a name m defines: the caller then falls back to m)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:  # relative: from the importing file's package up
        package = module.split(".") if is_package else module.split(".")[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join(package + ([base] if base else []))
    return [f"{base}.{a.name}" for a in node.names]


def file_import_graph(source: str) -> dict[str, set[str]]:
    """Core file -> the core files it imports (bench/ and train/ left out at both ends)."""
    files = _module_files(source)
    graph: dict[str, set[str]] = {}
    for module, rel in files.items():
        if rel.split(os.sep)[0] in NOT_CORE:
            continue
        with open(os.path.join(source, rel)) as f:
            tree = ast.parse(f.read(), rel)
        targets = graph.setdefault(rel, set())
        for node in ast.walk(tree):
            for name in _imported_modules(node, module, rel.endswith("__init__.py")):
                while name and name not in files:  # a name inside a module: the module
                    name = name.rpartition(".")[0]
                dst = files.get(name)
                if dst is not None and dst != rel and dst.split(os.sep)[0] not in NOT_CORE:
                    targets.add(dst)
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """The groups of two or more files that import each other, directly or around (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = set()
            while not group or node not in group:
                group.add(stack.pop())
            if len(group) > 1:
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def file_cycles(source: str) -> list[str]:
    """Each import cycle between core files, as one path around it."""
    graph = file_import_graph(source)
    problems = []
    for group in strongly_connected(graph):
        inside = {src: {dst: [src] for dst in graph[src] & group} for src in sorted(group)}
        problems.append("file import cycle: " + " -> ".join(find_cycle(inside)))
    return sorted(problems)


def size_violations(source: str) -> list[str]:
    problems = []
    for folder, dirs, files in os.walk(source):
        for d in dirs:
            if d in FORBIDDEN_PACKAGE_NAMES:
                problems.append(f"package named {d!r}: {os.path.relpath(os.path.join(folder, d), source)}")
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(folder, name)) as f:
                    n = sum(1 for _ in f)
                if n > MAX_LINES:
                    problems.append(f"{os.path.relpath(os.path.join(folder, name), source)}: {n} lines > {MAX_LINES}")
    return problems


def long_functions(source: str) -> list[str]:
    """Functions of the core packages longer than MAX_FUNCTION_LINES (decorators excluded)."""
    problems = []
    for folder, _, files in os.walk(source):
        rel = os.path.relpath(folder, source)
        if rel.split(os.sep)[0] in NOT_CORE:
            continue
        for name in (f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            with open(path) as f:
                tree = ast.parse(f.read())
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    n = node.end_lineno - node.lineno + 1
                    if n > MAX_FUNCTION_LINES:
                        problems.append(f"{os.path.relpath(path, source)}:{node.lineno} {node.name}: {n} lines")
    return problems


def experiment_imports(source: str) -> list[str]:
    """Files of the package that import the repository's benchmarks/ (not installed with it)."""
    found = []
    for folder, _, files in os.walk(source):
        for name in (f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            with open(path) as f:
                tree = ast.parse(f.read())
            for node in ast.walk(tree):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                    [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
                if any(n == "benchmarks" or n.startswith("benchmarks.") for n in names):
                    found.append(os.path.relpath(path, source))
    return found


def test_the_package_never_imports_the_experiments():
    assert experiment_imports(SOURCE) == []


def test_packages_import_only_along_allowed_arrows():
    assert layering_violations(SOURCE) == []


def test_no_import_cycle_between_the_core_files():
    assert file_cycles(SOURCE) == []



def test_no_large_files_and_no_ambiguous_package_names():
    assert size_violations(SOURCE) == []


def test_no_long_functions_in_the_core_packages():
    assert long_functions(SOURCE) == []


@pytest.fixture
def source_copy(tmp_path):
    dst = tmp_path / "specserve"
    shutil.copytree(SOURCE, dst, ignore=shutil.ignore_patterns("__pycache__", "*.safetensors", "*.png"))
    return dst


def test_mutation_back_edge_from_models_to_the_scheduler_is_reported(source_copy):
    with open(source_copy / "models" / "llama.py", "a") as f:
        f.write("\n\ndef _planted():\n    from specserve.scheduler.req import Req  # a lazy back-edge\n    return Req\n")
    problems = layering_violations(str(source_copy))
    assert any(p.startswith("models imports scheduler (models/llama.py)") for p in problems), problems


def test_mutation_cycle_between_allowed_packages_is_reported(source_copy):
    with open(source_copy / "kv" / "pool.py", "a") as f:
        f.write("\nfrom specserve.executor import step_io  # executor already imports kv\n")
    problems = layering_violations(str(source_copy))
    assert "kv -> executor is not an allowed arrow (kv/pool.py)" in problems
    assert any(p.startswith("import cycle:") and "kv" in p and "executor" in p for p in problems), problems


def test_mutation_an_import_of_the_experiments_is_reported(source_copy):
    with open(source_copy / "bench" / "offline.py", "a") as f:
        f.write("\n\ndef _planted():\n    from benchmarks.render import engine  # not installed with the package\n    return engine\n")
    assert experiment_imports(str(source_copy)) == ["bench/offline.py"]


def test_mutation_file_cycle_inside_a_package_is_reported(source_copy):
    """A lazy import from models/layers.py back up to models/llama.py (which imports layers): no
    package arrow changes, so only the file-level check sees it."""
    with open(source_copy / "models" / "layers.py", "a") as f:
        f.write("\n\ndef _planted():\n    from specserve.models.llama import LlamaForCausalLM\n"
                "    return LlamaForCausalLM\n")
    assert layering_violations(str(source_copy)) == []
    problems = file_cycles(str(source_copy))
    assert len(problems) == 1 and problems[0].startswith("file import cycle: "), problems
    assert "models/layers.py -> models/llama.py" in problems[0], problems  # the planted edge, on the path


def test_mutation_relative_import_cycle_and_one_through_a_package_init_are_reported(source_copy):
    with open(source_copy / "kv" / "pool.py", "a") as f:  # a relative import counts as its absolute twin
        f.write("\n\ndef _planted():\n    from .. import kv\n    from ..kv import radix_cache\n    return kv, radix_cache\n")
    with open(source_copy / "kv" / "radix_cache.py", "a") as f:
        f.write("\n\ndef _planted():\n    from . import pool\n    return pool\n")
    with open(source_copy / "engine" / "builder.py", "a") as f:  # engine.py imports builder.py
        f.write("\n\ndef _planted():\n    from specserve.engine import Engine  # a name engine/__init__.py gives\n"
                "    return Engine\n")
    problems = file_cycles(str(source_copy))
    assert "file import cycle: kv/pool.py -> kv/radix_cache.py -> kv/pool.py" in problems, problems
    through_init = [p for p in problems if "engine/builder.py" in p]
    assert len(through_init) == 1 and "engine/__init__.py" in through_init[0], problems


def test_mutation_oversized_file_and_old_package_name_are_reported(source_copy):
    (source_copy / "dist").mkdir()
    (source_copy / "dist" / "__init__.py").write_text("\n" * (MAX_LINES + 1))
    problems = size_violations(str(source_copy))
    assert "package named 'dist': dist" in problems
    assert f"dist/__init__.py: {MAX_LINES + 1} lines > {MAX_LINES}" in problems


def test_mutation_long_function_is_reported_outside_bench_and_train_only(source_copy):
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES - 1))
    planted = f"\n\ndef _planted():\n{body}"  # MAX_FUNCTION_LINES lines: allowed
    with open(source_copy / "names.py", "a") as f:
        f.write(planted + "\n\ndef _planted_long():\n" + body + "    return x0\n")
    with open(source_copy / "bench" / "offline.py", "a") as f:
        f.write("\n\ndef _planted_long():\n" + body + "    return x0\n")
    problems = long_functions(str(source_copy))
    assert [p.split(" ", 1)[1] for p in problems] == [f"_planted_long: {MAX_FUNCTION_LINES + 1} lines"], problems
    assert problems[0].startswith("names.py:")
