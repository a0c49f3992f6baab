"""What crosses ranks is JSON, never pickle; the consensus checker's history is bounded and its
death is fatal. One-rank groups in this process, and one spawned pair for the planted payload."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import socket
import time

import pytest

from specserve.distributed.wire import MalformedPayload, decode, encode
from specserve.engine.broadcast import decode_add, decode_commands, encode_add, encode_commands
from specserve.engine.messages import AbortRequest, AddRequest, Drain, FlushCache, Shutdown
from specserve.sampling_params import SamplingParams


def _addr() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def _add() -> AddRequest:
    params = SamplingParams(max_new_tokens=7, temperature=0.5, top_k=3, stop=["\n\n"], stop_token_ids=[2], seed=11,
                            logit_bias={5: -1.5})
    return AddRequest(rid="r-1", input_ids=[1, 2, 3], params=params, seed=2**63 - 5)


def test_commands_round_trip_through_json():
    """Rank 0 republishes the messages the front end sent: the same classes, the same values."""
    commands = [_add(), AbortRequest("r-0"), Drain(), Shutdown(), FlushCache("f-1")]
    payload = decode(encode(encode_commands(commands)), "engine.commands", 1)
    add, abort, drain, shutdown, flush = decode_commands(payload)
    assert add == _add() and isinstance(add.params, SamplingParams)
    assert flush == FlushCache("f-1")
    assert abort == AbortRequest("r-0") and drain == Drain() and shutdown == Shutdown()


class Boom:
    """A pickle that, loaded, creates the file `marker` (what a pickled payload could make a peer run)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("payload, message", [
    (None, "not JSON"),  # a pickle (made in the test: it names the test's own marker file)
    (b'[{"kind": "exec", "code": "1"}]', "unknown command kind 'exec'"),
    (b'{"kind": "add"}', "expected a list of commands"),
    (b'[{"kind": "add", "req": {"rid": "x"}}]', "request fields"),
    (b'[{"kind": "abort", "rid": 5}]', "without a string rid"),
    (b'[{"kind": "flush"}]', "without a string token"),
])
def test_malformed_command_payloads_raise_a_clear_error(payload, message, tmp_path):
    marker = tmp_path / "pickle-ran"
    payload = payload or pickle.dumps([Boom(str(marker))])
    with pytest.raises(MalformedPayload, match="malformed payload at site 'engine.commands'") as info:
        decode_commands(decode(payload, "engine.commands", 1))
    assert message in str(info.value)
    assert not marker.exists()


def test_a_request_with_bad_field_types_is_malformed():
    good = encode_add(_add())
    for name, bad in (("input_ids", [1, "2"]), ("seed", True), ("rid", 3)):
        with pytest.raises(MalformedPayload, match=name):
            decode_add({**good, name: bad})
    with pytest.raises(MalformedPayload, match="sampling params"):
        decode_add({**good, "params": {**good["params"], "top_p": 7}})


def _planted_rank(rank: int, addr: str, marker: str, out) -> None:
    """Rank 0 sends a pickle where JSON belongs (the old wire format, carrying a payload that runs a
    command when unpickled); rank 1 must refuse it."""
    import torch

    from specserve.distributed.group import DistConfig, TPGroup

    group = TPGroup(DistConfig(rank, 2, addr, timeout_s=20))
    if rank == 0:
        data = torch.frombuffer(bytearray(pickle.dumps([Boom(marker)])), dtype=torch.uint8)
        group.broadcast_(torch.tensor([data.numel()]), "engine.commands")
        group.broadcast_(data, "engine.commands")
        out.put((rank, "sent"))
        return
    try:
        group.broadcast_json(None, "engine.commands")
        out.put((rank, "accepted"))
    except MalformedPayload as exc:
        out.put((rank, str(exc)))


def test_a_planted_pickle_payload_is_refused_not_run(tmp_path):
    ctx = mp.get_context("spawn")
    out, addr, marker = ctx.Queue(), _addr(), tmp_path / "pickle-ran"
    procs = [ctx.Process(target=_planted_rank, args=(r, addr, str(marker), out)) for r in (0, 1)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    assert got[1].startswith("malformed payload at site 'engine.commands' on rank 1: not JSON"), got
    assert not marker.exists()


@pytest.fixture
def one_rank_group():
    from specserve.distributed.group import DistConfig, TPGroup

    group = TPGroup(DistConfig(0, 1, _addr(), timeout_s=10))
    yield group
    group.close()


def _wait(predicate, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_checker_history_is_bounded_and_totals_are_counted(one_rank_group):
    from specserve.distributed.consensus import CHECKED_HISTORY, RankConsensusChecker

    checker = RankConsensusChecker(one_rank_group, interval_s=0.005)
    for i in range(5 * CHECKED_HISTORY):
        checker.record("committed", ("r", i, [i, i + 1]))
    _wait(lambda: checker.checked == 5 * CHECKED_HISTORY)
    assert checker.events == [] and len(checker.history) == CHECKED_HISTORY
    assert checker.history[-1] == ("committed", ("r", 5 * CHECKED_HISTORY - 1, [5 * CHECKED_HISTORY - 1,
                                                                                 5 * CHECKED_HISTORY]))
    checker.record("committed", ("r", -1, []))
    checker.stop()  # the last round checks what is left, then the thread ends
    figures = checker.figures()
    assert figures["events_recorded"] == figures["events_checked"] == 5 * CHECKED_HISTORY + 1
    assert figures["alive"] and figures["checks"] > 0 and figures["error"] is None


def test_a_dead_checker_thread_fails_the_next_step(one_rank_group, caplog):
    from specserve.distributed.consensus import ConsensusCheckerDied, RankConsensusChecker

    checker = RankConsensusChecker(one_rank_group, interval_s=0.005, kill_at_round=3)
    _wait(lambda: not checker.alive)
    assert checker.error.startswith("rank consensus checker died on rank 0: RuntimeError: fault injection")
    assert any(r.levelname == "CRITICAL" and "checker died" in r.getMessage() for r in caplog.records)
    with pytest.raises(ConsensusCheckerDied, match="died on rank 0"):
        checker.raise_if_dead()
    checker.stop(timeout_s=1)
    assert checker.figures()["alive"] is False
