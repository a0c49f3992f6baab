"""Workloads where speculation matters, built from the prompt packages the benches already use
(specserve/datasets.py): each is a list of chat requests ({"category", "messages"[, "json_schema"]}).

- multiturn: ShareGPT V3 conversations at their second user turn (the first exchange as history),
  so an answer may reuse what the conversation already holds.
- code-edit: a HumanEval solution with a requested change; the answer repeats most of the input.
- extraction: a ShareGPT first turn's facts as a JSON object under a JSON schema (the grammar forces
  the form; the keys repeat from answer to answer).
- repeated-task: one instruction over many inputs, as an agent loop sends it (a HumanEval
  function's summary card): the answers share their form, request after request.
- mtbench, humaneval: MT-Bench first turns and HumanEval completions, where little repeats.
Deterministic: the same requests on every machine for the same packages.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from specserve.datasets import humaneval_problems, humaneval_prompts, mtbench_first_turns, sharegpt_records
from specserve.errors import ConfigError

Request = dict[str, Any]

CODE_EDITS = (
    "Rename the function to `{name}_v2` and add type hints wherever they are missing. Return the whole code.",
    "Add a check at the top of the function that raises ValueError on invalid input. Return the whole code.",
    "Rewrite the docstring's examples as a comment block above the function. Return the whole code.",
    "Add a short comment above every line of the function body. Return the whole code.",
)
EXTRACTION_SCHEMA = {
    "type": "object",
    "properties": {
        "topic": {"type": "string"},
        "language": {"type": "string"},
        "asks_for": {"type": "string"},
        "named_entities": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "is_question": {"type": "boolean"},
    },
    "required": ["topic", "language", "asks_for", "named_entities", "is_question"],
}
CARD = (
    "Describe the function below as a card in exactly this form:\n"
    "Name: <name>\nInputs: <each argument and its type>\nOutput: <the return type>\n"
    "Purpose: <one sentence>\nExample: <one call and its result>\n\n{code}"
)


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def multiturn(limit: int, max_chars: int = 1500) -> list[Request]:
    """ShareGPT conversations at their second user turn: [user, assistant, user]."""
    out: list[Request] = []
    for record in sharegpt_records():
        turns = [t for t in record.get("conversations") or [] if t.get("from") in ("human", "gpt")]
        start = next((i for i, t in enumerate(turns) if t["from"] == "human"), None)
        if start is None or len(turns) < start + 3:
            continue
        a, b, c = turns[start : start + 3]
        texts = [a.get("value", ""), b.get("value", ""), c.get("value", "")]
        if (b["from"], c["from"]) != ("gpt", "human") or not all(8 <= len(t) for t in texts):
            continue
        if sum(len(t) for t in texts) > max_chars:
            continue
        roles = ("user", "assistant", "user")
        out.append({"category": "multiturn", "messages": [{"role": r, "content": t} for r, t in zip(roles, texts)]})
        if len(out) == limit:
            break
    return out


def code_edit(limit: int) -> list[Request]:
    """HumanEval solutions (prompt and canonical solution) with one of CODE_EDITS asked."""
    rows = humaneval_problems()[:limit]
    return [
        {
            "category": "code-edit",
            "messages": _user(
                "```python\n" + (r["prompt"] + r["canonical_solution"]).strip() + "\n```\n\n"
                + CODE_EDITS[i % len(CODE_EDITS)].format(name=r["entry_point"])
            ),
        }
        for i, r in enumerate(rows)
    ]


def extraction(limit: int, max_chars: int = 800) -> list[Request]:
    """ShareGPT first user turns (from the file's end, away from multiturn's) to a JSON object."""
    texts: list[str] = []
    for record in sharegpt_records():
        turns = record.get("conversations") or []
        first = next((t.get("value", "") for t in turns if t.get("from") == "human"), "").strip()
        if 40 <= len(first) <= max_chars:
            texts.append(first)
    schema = json.dumps(EXTRACTION_SCHEMA)
    return [
        {
            "category": "extraction",
            "messages": _user(f"Extract the facts of this message as JSON ({schema}).\n\nMessage:\n{text}"),
            "json_schema": schema,
        }
        for text in texts[-limit:]
    ]


def repeated_task(limit: int) -> list[Request]:
    """One instruction (CARD) over HumanEval functions' signatures and docstrings."""
    rows = humaneval_problems()[-limit:]
    return [{"category": "repeated-task", "messages": _user(CARD.format(code=r["prompt"].strip()))} for r in rows]


def _plain(items: list[dict[str, str]]) -> list[Request]:
    return [{"category": q["category"], "messages": _user(q["prompt"])} for q in items]


WORKLOADS: dict[str, Callable[[int], list[Request]]] = {
    "multiturn": multiturn,
    "code-edit": code_edit,
    "extraction": extraction,
    "repeated-task": repeated_task,
    "mtbench": lambda n: _plain(mtbench_first_turns()[:n]),
    "humaneval": lambda n: _plain(humaneval_prompts()[:n]),
}


def load_workloads(names: str, limit: int) -> dict[str, list[Request]]:
    """The named workloads (comma-separated), `limit` requests each."""
    chosen = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in chosen if n not in WORKLOADS]
    if unknown or not chosen:
        raise ConfigError(f"--workloads: a comma-separated subset of {', '.join(WORKLOADS)}, got {names!r}")
    return {n: WORKLOADS[n](limit) for n in chosen}
