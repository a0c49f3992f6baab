"""Shard selection for training (--sources, --shards) and the cost book-keeping of the
drafter-sources experiment: data already paid for costs nothing again, unknown costs refuse."""

import pytest

from specserve.train.corpus_store import CorpusStore, Pair, prompt_key
from specserve.train.run import parse_shard_numbers, select_shards, shard_number
from benchmarks.source_value import arm_cost_seconds, parse_arms


def _store(tmp_path):
    store = CorpusStore(str(tmp_path))
    for n, source in enumerate(["sharegpt-greedy", "sharegpt-greedy", "sharegpt-answers", "sharegpt-greedy"]):
        pairs = [Pair([1, 5, n], [7, n, 2], prompt_key(f"{source} {n} {i}")) for i in range(2)]
        store.append(source, pairs, {}, 100.0 * (n + 1), "test machine")
    return store


class _Cache:
    def __init__(self, costs):
        self.costs = costs

    def cost(self, info):
        return self.costs.get(shard_number(info))


def test_shard_numbers_and_ranges():
    assert parse_shard_numbers("0-2,5") == {0, 1, 2, 5}
    assert parse_shard_numbers("3") == {3}
    with pytest.raises(ValueError, match="shard numbers and ranges"):
        parse_shard_numbers("0-x")


def test_shards_are_selected_by_source_and_number(tmp_path):
    store = _store(tmp_path)
    assert [shard_number(s) for s in select_shards(store, None, None)] == [0, 1, 2, 3]
    assert [shard_number(s) for s in select_shards(store, ["sharegpt-greedy"], None)] == [0, 1, 3]
    assert [shard_number(s) for s in select_shards(store, ["sharegpt-greedy"], "1-3")] == [1, 3]
    with pytest.raises(ValueError, match="no corpus shard matches"):
        select_shards(store, ["sharegpt-answers"], "0-1")


def test_arms_parse_and_refuse_malformed_specs():
    assert parse_arms("a:sharegpt-greedy:0-4, b:sharegpt-answers:5") == [("a", "sharegpt-greedy", "0-4"),
                                                                          ("b", "sharegpt-answers", "5")]
    for bad in ("a:sharegpt-greedy", "a::5", "a:b:c:d"):
        with pytest.raises(ValueError, match="NAME:SOURCE:SHARDS"):
            parse_arms(bad)


def test_an_arm_pays_for_new_data_only(tmp_path):
    store = _store(tmp_path)
    cache = _Cache({1: {"tokens": 10, "seconds": 7.0}, 3: {"tokens": 10, "seconds": 9.0}})
    greedy = select_shards(store, ["sharegpt-greedy"], None)  # shards 0, 1, 3 made in 100, 200, 400 s
    cost = arm_cost_seconds(greedy, seen={0}, cache=cache, train_seconds=60.0)
    assert cost == {"making_s": 600.0, "teacher_s": 16.0, "train_s": 60.0, "total_s": 676.0}
    seen_only = arm_cost_seconds(greedy[:1], seen={0}, cache=cache, train_seconds=60.0)
    assert seen_only["total_s"] == 60.0
    with pytest.raises(ValueError, match="no recorded cost"):  # shard 0 not seen: its teacher cost is unknown
        arm_cost_seconds(greedy, seen=set(), cache=cache, train_seconds=60.0)


def test_shape_arms_take_shape_flags_only():
    from benchmarks.shape_ablation import DEFAULT_SHAPE_ARMS, parse_shape_arms

    arms = parse_shape_arms("base=;deep=--num-layers 2 --block-size 6")
    assert arms == [("base", []), ("deep", ["--num-layers", "2", "--block-size", "6"])]
    assert [n for n, _ in parse_shape_arms(DEFAULT_SHAPE_ARMS, only="base,block8")] == ["base", "block8"]
    for bad in ("x=--lr 1e-2", "x=--num-layers", "=--num-layers 2", "x"):  # a training flag would confound the arm
        with pytest.raises(ValueError, match="NAME=FLAGS"):
            parse_shape_arms(bad)
    with pytest.raises(ValueError, match="no arm named"):
        parse_shape_arms(DEFAULT_SHAPE_ARMS, only="nope")


def test_a_shape_arm_is_reused_only_when_trained_as_asked():
    from benchmarks.arms import train_parser
    from benchmarks.shape_ablation import trained_as_asked

    argv = ["--out", "x", "--shards", "0", "--max-minutes", "5", "--note", "drafter-shapes arm block8",
            "--block-size", "8"]
    asked = vars(train_parser().parse_args(argv))
    record = {"started_from": "scratch", "args": dict(asked, out="elsewhere", note="an older note")}
    assert trained_as_asked(record, asked)  # where it was written and its note do not matter
    for key, other in (("block_size", 5), ("shards", "0-1"), ("max_minutes", 8.0), ("markov_rank", 16)):
        assert not trained_as_asked({**record, "args": {**record["args"], key: other}}, asked), key
    assert not trained_as_asked({**record, "started_from": "weights"}, asked)
