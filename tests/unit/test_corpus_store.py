"""The drafter corpus kept in the repository: append-only shards of token ids with a manifest, a
size budget, de-duplication by prompt, and evaluation prompts kept out of training."""

import json
import os

import pytest

from specserve.train.corpus_store import CorpusStore, Pair, prompt_key
from specserve.train import sources


def _pairs(n, start=0):
    return [Pair([1, 10 + i, 11], [20 + i, 21, 2], prompt_key(f"prompt {start + i}")) for i in range(n)]


def test_shards_round_trip_and_the_manifest_counts_them(tmp_path):
    store = CorpusStore(str(tmp_path))
    store.append("sharegpt-greedy", _pairs(3), {"max_new_tokens": 8}, 1.5, "test machine")
    store.append("sharegpt-answers", _pairs(2, 10), {}, 0.1, "test machine")
    again = CorpusStore(str(tmp_path))  # read back from manifest.json
    assert [s.file for s in again.shards] == ["shards/00000-sharegpt-greedy.npz", "shards/00001-sharegpt-answers.npz"]
    assert again.counts() == {"shards": 2, "sequences": 5, "prompt_tokens": 15, "answer_tokens": 15}
    assert again.counts("sharegpt-answers")["sequences"] == 2
    got = [p for _, p in again.pairs(["sharegpt-greedy"])]
    assert [(p.prompt_ids, p.answer_ids, p.key) for p in got] == [(p.prompt_ids, p.answer_ids, p.key) for p in _pairs(3)]
    assert again.used_keys("sharegpt-answers") == {p.key for p in _pairs(2, 10)}
    manifest = json.load(open(tmp_path / "manifest.json"))
    assert manifest["by_source"]["sharegpt-greedy"]["answer_tokens"] == 9 and manifest["shards"][0]["seconds"] == 1.5


def test_two_writers_on_one_corpus_keep_both_shards(tmp_path):
    """Two `extend` processes at once: each append re-reads the manifest under the lock."""
    first, second = CorpusStore(str(tmp_path)), CorpusStore(str(tmp_path))  # both see an empty corpus
    first.append("sharegpt-greedy", _pairs(2), {}, 1.0, "m")
    second.append("sharegpt-sampled", _pairs(3, 10), {}, 1.0, "m")
    again = CorpusStore(str(tmp_path))
    assert [s.file for s in again.shards] == ["shards/00000-sharegpt-greedy.npz", "shards/00001-sharegpt-sampled.npz"]
    assert again.counts()["sequences"] == 5


def test_a_rewritten_shard_is_refused(tmp_path):
    store = CorpusStore(str(tmp_path))
    info = store.append("sharegpt-greedy", _pairs(2), {}, 1.0, "m")
    other = CorpusStore(str(tmp_path / "other"))
    other.append("sharegpt-greedy", _pairs(2, 5), {}, 1.0, "m")
    os.replace(tmp_path / "other" / info.file, tmp_path / info.file)  # same name, different content
    with pytest.raises(ValueError, match="sha256"):
        list(CorpusStore(str(tmp_path)).pairs())


def test_the_size_budget_is_enforced(tmp_path):
    store = CorpusStore(str(tmp_path), budget_bytes=10)
    with pytest.raises(ValueError, match="budget"):
        store.append("sharegpt-greedy", _pairs(2), {}, 1.0, "m")
    assert store.shards == [] and not os.listdir(tmp_path / "shards")


def test_ids_must_fit_uint16(tmp_path):
    with pytest.raises(ValueError, match="uint16"):
        CorpusStore(str(tmp_path)).append("x", [Pair([70000], [1], 1)], {}, 0.0, "m")


def test_training_prompts_exclude_benchmarks_and_the_evaluation_sets(tmp_path):
    store = CorpusStore(str(tmp_path))
    pool = sources.sharegpt_pool()
    sets = sources.evaluation_sets(str(tmp_path), pool)
    assert len(sets["dev"]) == len(sets["heldout"]) == sources.SET_SIZE
    assert not set(sets["dev"]) & set(sets["heldout"])
    train = sources.training_prompts(str(tmp_path), store, "sharegpt-greedy")
    keys = {prompt_key(h) for h, _ in train}
    assert not keys & {prompt_key(p) for p in sets["dev"] + sets["heldout"]}
    assert not keys & sources.benchmark_keys()
    assert len(train) == len(pool) - 2 * sources.SET_SIZE
    store.append("sharegpt-greedy", [Pair([1], [2, 2], prompt_key(train[0][0]))], {}, 0.0, "m")
    assert sources.training_prompts(str(tmp_path), store, "sharegpt-greedy")[0] == train[1]  # answered once
    assert sources.training_prompts(str(tmp_path), store, "sharegpt-answers")[0] == train[0]  # per source


def test_the_committed_corpus_is_intact_and_keeps_the_evaluation_prompts_out():
    from specserve.train.corpus_cli import DEFAULT_DATA_DIR

    store = CorpusStore(DEFAULT_DATA_DIR)
    assert store.shards and store.total_bytes <= store.budget_bytes
    by_source: dict[str, list[int]] = {}
    for info, pair in store.pairs():  # every shard's sha256 is checked on read
        by_source.setdefault(info.source, []).append(pair.key)
    assert {s: len(k) for s, k in by_source.items()} == {s: store.counts(s)["sequences"] for s in store.sources()}
    assert all(len(set(keys)) == len(keys) for keys in by_source.values())  # one answer per prompt and source
    sets = sources.evaluation_sets(DEFAULT_DATA_DIR)
    evaluation = {prompt_key(p) for prompts in sets.values() for p in prompts} | sources.benchmark_keys()
    assert not evaluation & {k for keys in by_source.values() for k in keys}
