"""A drafter line's held-out sequences are fixed once chosen and never include anything it trained on."""

from specserve.train.held_out import HELD_OUT_KEYS, choose_held_out_keys, record_held_out_keys, trained_shards


def _extension(state: dict, shards: list[str]) -> None:
    state.setdefault("extensions", []).append({"shards": shards})


def test_a_new_line_holds_out_the_smallest_keys_at_most_half():
    keys = [50, 10, 40, 20, 30, 60]
    assert choose_held_out_keys(keys, ["a.npz"] * 6, {}, size=2, trained_keys=[]) == {10, 20}
    assert choose_held_out_keys(keys, ["a.npz"] * 6, {}, size=100, trained_keys=[]) == {10, 20, 30}


def test_the_recorded_keys_stay_held_out_when_the_corpus_grows_smaller_keys():
    state: dict = {}
    held = choose_held_out_keys([50, 60, 70, 80], ["a.npz"] * 4, state, size=2, trained_keys=[])
    record_held_out_keys(state, held)
    _extension(state, ["a.npz"])
    grown = [50, 60, 70, 80, 1, 2, 3]  # a new shard with smaller keys (and one shared prompt)
    shards = ["a.npz"] * 4 + ["b.npz"] * 3
    assert choose_held_out_keys(grown, shards, state, size=2, trained_keys=[50, 60, 70, 80]) == {50, 60}


def test_new_shards_alone_get_fresh_keys_the_line_never_trained_on():
    state = {HELD_OUT_KEYS: [5, 6]}
    _extension(state, ["a.npz"])
    # b repeats prompt 7, which the line trained on in shard a under another source
    keys, shards = [7, 8, 9, 10, 11, 12], ["b.npz"] * 6
    chosen = choose_held_out_keys(keys, shards, state, size=2, trained_keys=[5, 6, 7])
    assert chosen == {8, 9}
    record_held_out_keys(state, chosen)
    assert state[HELD_OUT_KEYS] == [5, 6, 8, 9]


def test_only_trained_prompts_give_no_held_out_rather_than_a_contaminated_one():
    state = {HELD_OUT_KEYS: [99]}
    _extension(state, ["a.npz"])
    assert choose_held_out_keys([1, 2, 3], ["a.npz"] * 3, state, size=2, trained_keys=[1, 2, 3]) == set()
    # another source's answers to the same prompts are no cleaner
    assert choose_held_out_keys([1, 2, 3], ["b.npz"] * 3, state, size=2, trained_keys=[1, 2, 3]) == set()


def test_no_extension_ever_scores_a_sequence_an_earlier_one_trained_on():
    state: dict = {}
    shards = {"a.npz": [40, 41, 42, 43], "b.npz": [10, 11, 12, 13], "c.npz": [1, 2, 3, 44]}
    trained: set[int] = set()
    for run in (["a.npz"], ["a.npz", "b.npz"], ["c.npz"], ["a.npz", "b.npz", "c.npz"]):
        keys = [k for name in run for k in shards[name]]
        held = choose_held_out_keys(keys, [n for n in run for _ in shards[n]], state, 1, trained)
        assert not held & trained
        record_held_out_keys(state, held)
        trained |= set(keys) - held
        _extension(state, run)
    assert trained_shards(state) == set(shards)
