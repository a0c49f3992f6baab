"""The speculation workloads: built from the installed prompt packages, deterministic, of the
shape each promises."""

from __future__ import annotations

import json

import pytest

from specserve.bench.workloads import CODE_EDITS, WORKLOADS, load_workloads
from specserve.errors import ConfigError


@pytest.fixture(scope="module")
def workloads():
    return load_workloads(",".join(WORKLOADS), 6)


def test_every_workload_has_its_requests_and_is_deterministic(workloads):
    again = load_workloads("multiturn,code-edit", 6)
    for name, requests in workloads.items():
        assert len(requests) == 6, name
        for r in requests:
            assert r["messages"][-1]["role"] == "user" and all(m["content"].strip() for m in r["messages"])
    assert again["multiturn"] == workloads["multiturn"] and again["code-edit"] == workloads["code-edit"]


def test_multiturn_asks_a_second_turn_after_a_real_answer(workloads):
    for r in workloads["multiturn"]:
        assert [m["role"] for m in r["messages"]] == ["user", "assistant", "user"]


def test_code_edit_holds_the_solution_and_asks_a_change(workloads):
    for i, r in enumerate(workloads["code-edit"]):
        text = r["messages"][0]["content"]
        assert text.startswith("```python\n") and "def " in text and "return" in text
        assert text.endswith(CODE_EDITS[i % len(CODE_EDITS)].split("`")[-1])


def test_extraction_is_forced_by_a_json_schema(workloads):
    for r in workloads["extraction"]:
        schema = json.loads(r["json_schema"])
        assert schema["type"] == "object" and set(schema["required"]) == set(schema["properties"])


def test_the_repeated_task_is_one_instruction_over_different_inputs(workloads):
    texts = [r["messages"][0]["content"] for r in workloads["repeated-task"]]
    heads = {t.split("\n\n")[0] for t in texts}
    assert len(heads) == 1 and len(set(texts)) == len(texts)


def test_an_unknown_workload_is_a_clear_error():
    with pytest.raises(ConfigError, match="--workloads"):
        load_workloads("mtbench,nope", 2)
