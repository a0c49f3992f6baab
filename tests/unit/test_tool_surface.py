"""The tools' surface of the engine (engine/tools.py): bench/, train/, benchmarks/ and scripts/ use
named methods of `Engine`, never attribute chains into the runner (issue 71, item 6).

The scan reads every .py file under those folders (code added later included) with `ast`: an
attribute named `runner` (`engine.runner`, `x.runner.model`), an attribute of a name `runner`
(`runner.kv`), or `getattr(x, "runner")`; comments and strings are not code and do not count. The
planted tests show that it reports each form, in a string and in a file. The methods themselves run
on the shared fp32 engine in tests/integration/test_tool_methods.py.
"""

from __future__ import annotations

import ast
import os
import shutil

import specserve

REPO = os.path.dirname(os.path.dirname(os.path.abspath(specserve.__file__)))
TOOL_FOLDERS = ("specserve/bench", "specserve/train", "benchmarks", "scripts")


def runner_chains(source: str) -> list[tuple[int, str]]:
    """(line, code) of each reach into a runner in `source`."""
    lines = source.splitlines()
    hits = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and (
            node.attr == "runner" or (isinstance(node.value, ast.Name) and node.value.id == "runner")
        ):
            hits.add(node.lineno)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value == "runner"
        ):
            hits.add(node.lineno)
    return [(n, lines[n - 1].strip()) for n in sorted(hits)]


def tool_files(root: str) -> list[str]:
    out = []
    for folder in TOOL_FOLDERS:
        for parent, _, files in os.walk(os.path.join(root, folder)):
            out += [os.path.join(parent, name) for name in files if name.endswith(".py")]
    return sorted(out)


def scan(root: str) -> list[str]:
    """`path:line: code` of every runner chain in the tool folders under `root`."""
    found = []
    for path in tool_files(root):
        with open(path) as f:
            source = f.read()
        found += [f"{os.path.relpath(path, root)}:{n}: {code}" for n, code in runner_chains(source)]
    return found


def test_the_tools_never_reach_into_the_runner():
    assert len(tool_files(REPO)) > 50  # the folders are where the scan looks
    found = scan(REPO)
    assert not found, "attribute chains into the runner (use Engine's tool methods, engine/tools.py):\n" + "\n".join(found)


PLANTED = '''"""Docstring naming engine.runner.model, and on the runner."""
model = engine.runner.model  # 2
runner = engine.runner  # 3
kv = runner.kv  # 4
r = getattr(engine, "runner")  # 5
x = "engine.runner.kv"  # a string: not code
# engine.runner.kv in a comment
engine.target_model(engine.model)
'''


def test_the_scan_reports_every_planted_form_and_nothing_else():
    assert [n for n, _ in runner_chains(PLANTED)] == [2, 3, 4, 5]
    assert runner_chains(PLANTED)[0] == (2, "model = engine.runner.model  # 2")


def test_the_scan_reports_a_planted_chain_in_a_tool_file(tmp_path):
    for folder in TOOL_FOLDERS:
        os.makedirs(tmp_path / folder)
    shutil.copy(os.path.join(REPO, "benchmarks", "moe_routing.py"), tmp_path / "benchmarks" / "moe_routing.py")
    os.makedirs(tmp_path / "benchmarks" / "later")
    (tmp_path / "benchmarks" / "later" / "new_bench.py").write_text("def f(engine):\n    return engine.runner.model\n")
    with open(tmp_path / "specserve" / "bench" / "planted.py", "w") as f:
        f.write("def g(engine):\n    engine.runner.req_to_token.table.zero_()\n")
    assert scan(str(tmp_path)) == [
        "benchmarks/later/new_bench.py:2: return engine.runner.model",
        "specserve/bench/planted.py:2: engine.runner.req_to_token.table.zero_()",
    ]
