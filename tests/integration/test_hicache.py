"""HiCache: host tier reloads, write policies, host-pool integrity, the file tier across restarts."""

from __future__ import annotations

import glob
import os
import stat

import pytest


LONG = ("The history of the printing press begins with movable type in East Asia and continues with "
        "Gutenberg's press in Mainz around 1450, which spread across Europe within decades. ") * 6
PROMPT_A = LONG + "Summarize this in one sentence."
FILLERS = [f"Write a short poem about the number {i} and the color {c}." * 3 for i, c in
           enumerate(["red", "blue", "green", "gold", "gray", "teal", "pink", "navy"])]
GREEDY = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}  # real outputs to compare


def engine(**kw):
    from specserve import Engine

    base = dict(dtype="float32", speculative_algorithm="NONE", max_total_tokens=480, enable_hierarchical_cache=True,
                hicache_ratio=4.0, max_running_requests=4)
    return Engine(**{**base, **kw})


def nodes(tree):
    return tree._all_nodes()


def churn(eng) -> None:
    """Enough other prompts to push PROMPT_A's KV out of the small device pool."""
    for filler in FILLERS:
        eng.generate(filler, sampling_params=GREEDY)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("algorithm", ["NONE", "DSPARK"])
def test_evicted_prefix_reloads_from_host_with_identical_output(algorithm, dtype):
    # DSPARK drafts every window whole (the policy off), so the drafts alone decide acceptance.
    # bf16 runs the default path (the CPU kernels): the reloaded KV must give the same tokens there too.
    fixed = {"speculative_policy": "fixed"} if algorithm == "DSPARK" else {}
    with engine(speculative_algorithm=algorithm, dtype=dtype, **fixed) as eng:
        first = eng.generate(PROMPT_A, sampling_params=GREEDY)
        churn(eng)
        assert eng.scheduler.ledger.tree.stats.device_evicted_to_host > 0
        again = eng.generate(PROMPT_A, sampling_params=GREEDY)
        assert eng.scheduler.ledger.tree.stats.host_hit_tokens > 0
        assert again["meta_info"]["cached_tokens"] > len(eng.tokenizer.encode(LONG)) // 2
        assert again["output_ids"] == first["output_ids"]
        if algorithm == "DSPARK":  # the drafter's KV came back too: same drafts, same acceptance
            assert again["meta_info"]["spec_num_correct_drafts"] == first["meta_info"]["spec_num_correct_drafts"]
        eng.scheduler.ledger.tree.check_host_integrity()
        eng.scheduler.check_integrity()


def test_write_through_backs_up_every_inserted_node():
    with engine(hicache_write_policy="write_through") as eng:
        eng.generate([PROMPT_A, FILLERS[0]], sampling_params=GREEDY)
        assert nodes(eng.scheduler.ledger.tree) and all(n.host_value is not None for n in nodes(eng.scheduler.ledger.tree))
        assert eng.scheduler.ledger.tree.stats.backups >= len(nodes(eng.scheduler.ledger.tree))
        eng.scheduler.ledger.tree.check_host_integrity()


def test_write_back_copies_only_at_eviction():
    with engine(hicache_write_policy="write_back") as eng:
        eng.generate(PROMPT_A, sampling_params=GREEDY)
        assert eng.scheduler.ledger.tree.stats.backups == 0 and all(n.host_value is None for n in nodes(eng.scheduler.ledger.tree))
        churn(eng)
        assert eng.scheduler.ledger.tree.stats.backups > 0 and eng.scheduler.ledger.tree.stats.device_evicted_to_host > 0
        again = eng.generate(PROMPT_A, sampling_params=GREEDY)
        assert eng.scheduler.ledger.tree.stats.host_hit_tokens > 0 and again["meta_info"]["cached_tokens"] > 0
        eng.scheduler.ledger.tree.check_host_integrity()
        eng.scheduler.check_integrity()


def test_host_integrity_check_catches_a_leaked_host_slot():
    """Mutation: a host slot that is neither free nor in the tree is reported."""
    with engine() as eng:
        eng.generate(PROMPT_A, sampling_params=GREEDY)
        eng.scheduler.ledger.tree.check_host_integrity()
        eng.scheduler.ledger.tree.host.alloc(1)  # taken and never recorded anywhere
        with pytest.raises(AssertionError, match="HiCache integrity"):
            eng.scheduler.ledger.tree.check_host_integrity()


def test_file_tier_survives_restart_and_treats_corruption_as_a_miss(tmp_path, monkeypatch):
    store = dict(hicache_storage_backend="file", hicache_storage_dir=str(tmp_path))
    with engine(**store) as eng:
        first = eng.generate(PROMPT_A, sampling_params=GREEDY)
        assert eng.scheduler.ledger.tree.stats.storage_pages_written >= 2
    with engine(**store) as eng:  # a new engine: empty device and host tiers, same directory
        again = eng.generate(PROMPT_A, sampling_params=GREEDY)
        assert eng.scheduler.ledger.tree.stats.storage_hit_tokens >= 128 and again["output_ids"] == first["output_ids"]
    pages = sorted(glob.glob(os.path.join(str(tmp_path), "*.kv")), key=os.path.getmtime)
    assert stat.S_IMODE(os.stat(tmp_path).st_mode) == 0o700
    assert {stat.S_IMODE(os.stat(p).st_mode) for p in pages} == {0o600}
    for page in pages:  # flip bytes in the middle of every payload
        with open(page, "r+b") as f:
            f.seek(os.path.getsize(page) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
    with engine(**store) as eng:
        again = eng.generate(PROMPT_A, sampling_params=GREEDY)
        assert eng.scheduler.ledger.tree.stats.storage_hit_tokens == 0  # every corrupted page is a miss
        assert again["output_ids"] == first["output_ids"]
    # The fingerprint as the builder makes it: a bfloat16 engine never loads the float32 pages, and
    # under a cap of their size its own pages evict the least recently used of them.
    cap = sum(os.path.getsize(p) for p in glob.glob(os.path.join(str(tmp_path), "*.kv")))
    with engine(**store, dtype="bfloat16", hicache_storage_max_bytes=cap) as eng:
        eng.generate(PROMPT_A, sampling_params=GREEDY)
        assert eng.scheduler.ledger.tree.stats.storage_hit_tokens == 0 and eng.scheduler.ledger.tree.stats.storage_pages_written >= 2
    assert sum(os.path.getsize(p) for p in glob.glob(os.path.join(str(tmp_path), "*.kv"))) <= cap

