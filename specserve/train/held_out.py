"""The held-out sequences of a drafter line: chosen once, recorded, never trained on.

A line is a drafter and its extensions (`train_state.json`). Its teacher-forced score is only
comparable from one extension to the next if every extension scores the same sequences and none
of them was ever trained on. So the prompt keys of the held-out sequences are recorded in the
state the first time and kept: every later extension holds out exactly the sequences with those
keys (any source's answer to such a prompt), whatever the corpus has grown to. Only when the
chosen shards hold none of them (a run on new shards alone) are new keys taken, from prompts the
line has never trained on, and added to the record; if every chosen prompt was trained on, the
run has no held-out set (and no teacher-forced score) rather than a contaminated one.
"""

from __future__ import annotations

from typing import Iterable

HELD_OUT_KEYS = "held_out_keys"


def trained_shards(state: dict) -> set[str]:
    """The shard files (`00003-sharegpt-greedy.npz`) any extension of the line trained on."""
    return {name for ext in state.get("extensions", []) for name in ext.get("shards", [])}


def choose_held_out_keys(keys: list[int], shard_of: list[str], state: dict, size: int,
                         trained_keys: Iterable[int]) -> set[int]:
    """The prompt keys to hold out among the chosen sequences (`keys[i]` from shard `shard_of[i]`).

    The line's recorded keys where the chosen sequences hold any; else the `size` smallest keys
    (at most half) of sequences outside the shards the line trained on and unlike `trained_keys`
    (prompts it trained on, whatever their source). Empty when every chosen prompt was trained on:
    such a run has no teacher-forced score rather than a contaminated one."""
    present = set(state.get(HELD_OUT_KEYS, ())) & set(keys)
    if present:
        return present
    seen_shards, seen_keys = trained_shards(state), set(trained_keys)
    fresh = sorted({key for key, shard in zip(keys, shard_of) if shard not in seen_shards} - seen_keys)
    return set(fresh[:min(size, len(fresh) // 2)])  # empty: nothing here is clean to score


def record_held_out_keys(state: dict, held: set[int]) -> None:
    """Add `held` to the line's record (a key once held out stays held out)."""
    state[HELD_OUT_KEYS] = sorted(set(state.get(HELD_OUT_KEYS, ())) | set(held))
