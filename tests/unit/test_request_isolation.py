"""Per-request failure isolation: hostile parameters are refused before the engine step, and a
request whose own host work fails (stop strings, detokenizing) fails alone while the others finish."""

from __future__ import annotations

import math
import queue
from types import SimpleNamespace

import pytest
import torch
from fake_runner import assert_no_leak, make_req, make_scheduler, run_to_completion

from specserve.engine.messages import AddRequest, RequestDone, RequestError, RequestFailed, Shutdown
from specserve.errors import InternalError, InvalidRequestError
from specserve.sampler import sample
from specserve.sampling_params import SamplingParams
from specserve.scheduler.req import FinishReason
from specserve.server.engine_process import EngineServer, one_line

VOCAB = 1000

HOSTILE = [
    ("top_k", 2**63),
    ("top_k", VOCAB + 1),
    ("seed", 2**64),
    ("seed", -1),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("temperature", 1e9),
    ("top_p", math.nan),
    ("min_p", math.inf),
    ("max_new_tokens", 2**63),
    ("ignore_eos", None),
    ("ignore_eos", "yes"),
    ("skip_special_tokens", None),
    ("skip_special_tokens", 1),
    ("stop", ["x"] * 17),
    ("stop", ["y" * 257]),
    ("stop_token_ids", list(range(257))),
    ("stop_token_ids", [VOCAB]),
    ("stop_token_ids", [True]),
    ("logit_bias", {"\u00b2": 1}),  # a digit to str.isdigit(), not to int()
]


@pytest.mark.parametrize("field,value", HOSTILE, ids=[f"{f}={str(v)[:12]}" for f, v in HOSTILE])
def test_hostile_values_are_refused_naming_the_field(field, value):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams.from_dict({field: value}).validate(VOCAB)
    assert err.value.param == f"sampling_params.{field}"
    assert len(str(err.value)) < 400  # a huge value is not echoed back whole


def test_limits_themselves_are_accepted():
    sp = SamplingParams.from_dict({"top_k": VOCAB, "seed": 2**64 - 1, "stop": ["s" * 256] * 16,
                                   "stop_token_ids": list(range(256)), "temperature": 100})
    sp.validate(VOCAB)


def test_sampling_params_must_be_an_object():
    for bad in ([1], "greedy", 3):
        with pytest.raises(InvalidRequestError, match="must be an object"):
            SamplingParams.from_dict(bad)


def test_tiny_temperature_is_greedy_not_nan():
    logits = torch.randn(3, 50)
    params = [SamplingParams(temperature=1e-30), SamplingParams(temperature=1e-6), SamplingParams(temperature=0.5)]
    out = sample(logits, params, seeds=[1, 2, 3], counters=[0, 0, 0])
    assert out[:2] == logits[:2].argmax(-1).tolist()
    assert 0 <= out[2] < 50


# ---------------------------------------------------------------- the scheduler: a failing stop check


def test_a_failing_stop_check_fails_that_request_alone():
    def decode(ids):
        if 666 in ids:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "planted")
        return "".join(chr(97 + t % 26) for t in ids)

    sched = make_scheduler(decode_text=decode)
    runner = sched.runner
    bad_prompt, good_prompt = [5, 6, 7], [8, 9, 10]
    runner.next_token = _forcing(runner.next_token, bad_prompt, 666)
    done = run_to_completion(sched, [make_req("bad", bad_prompt, 12, stop=["#never#"]),
                                     make_req("good", good_prompt, 12, stop=["#never#"])])
    assert done["bad"].finish_reason == FinishReason.ERROR and "planted" in done["bad"].error
    assert done["good"].finish_reason == FinishReason.LENGTH and len(done["good"].output_ids) == 12
    assert_no_leak(sched)


def _forcing(next_token, prompt, token):
    """The fake model emits `token` for `prompt`'s first output, its usual tokens elsewhere."""
    def patched(input_ids, output_ids):
        if list(input_ids) == prompt and not output_ids:
            return token
        return next_token(input_ids, output_ids)
    return patched


# ---------------------------------------------------------------- the engine process: per-request guards


class _Engine:
    """Just what EngineServer calls: add, abort, step, output, has_work, load. What each request
    plants is named by its rid."""

    def __init__(self):
        self.queued, self.finished = [], []

    def add(self, cmd):
        rid = cmd.rid
        if rid == "boom":
            raise TypeError("planted submit bug")
        if rid == "bad":
            raise InvalidRequestError("sampling_params.top_k: bad", param="sampling_params.top_k")
        if rid == "value_bug":  # a ValueError that is not the client's: a broken invariant
            raise ValueError("planted invariant")
        if rid == "internal":
            raise InternalError("planted internal error")
        error = "stop check" if rid == "err" else None
        self.queued.append(SimpleNamespace(rid=rid, error=error, output_fails=rid == "detok"))

    def abort(self, rid):
        pass

    def has_work(self):
        return bool(self.queued)

    def step(self):
        finished, self.queued = self.queued, []
        return SimpleNamespace(tokens=[], finished=finished, flushed=[])

    def output(self, req):
        if req.output_fails:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "planted detokenizer bug")
        return {"text": "ok", "meta_info": {"id": req.rid}}

    def load(self):
        return {}


class _ScriptedCommands:
    """A command queue that hands out its script one command per get (blocking or not), then
    Empty: the server sees a request, goes idle, then idles again, then stops."""

    def __init__(self, script):
        self.script = list(script)

    def get(self, timeout=None):
        return self.get_nowait()

    def get_nowait(self):
        if not self.script:
            raise queue.Empty
        cmd = self.script.pop(0)
        if cmd is None:  # a pause: nothing arrived in this wait
            raise queue.Empty
        return cmd


def test_an_idle_engine_hands_freed_heap_back_once_per_busy_spell(monkeypatch):
    """After the steps of a busy spell the loop's first idle pass trims the heap (heap.py); idle
    passes without work in between do not, and a server that never worked never trims."""
    import specserve.server.engine_process as engine_process

    trims = []
    monkeypatch.setattr(engine_process, "release_free_heap", lambda: trims.append(1))
    busy = [AddRequest("a", [1, 2], SamplingParams()), None, None, AddRequest("b", [1], SamplingParams()), None,
            None, Shutdown()]
    EngineServer(_Engine(), _ScriptedCommands(busy), queue.Queue()).run()
    assert len(trims) == 2  # after "a" and after "b", not on the idle passes between
    trims.clear()
    EngineServer(_Engine(), _ScriptedCommands([None, None, Shutdown()]), queue.Queue()).run()
    assert trims == []


def test_engine_server_fails_only_the_request_whose_host_work_raised():
    commands, events = queue.Queue(), queue.Queue()
    for rid in ["boom", "bad", "err", "detok", "fine", "value_bug", "internal"]:
        commands.put(AddRequest(rid, [1, 2], SamplingParams()))
    commands.put(Shutdown())
    EngineServer(_Engine(), commands, events).run()
    final = {}
    while not events.empty():
        for ev in events.get():
            if isinstance(ev, (RequestDone, RequestError, RequestFailed)):
                final[ev.rid] = ev
    assert isinstance(final["boom"], RequestFailed) and "planted submit bug" in final["boom"].message
    assert isinstance(final["bad"], RequestError) and final["bad"].param == "sampling_params.top_k"
    assert isinstance(final["err"], RequestFailed) and final["err"].message == "stop check"
    assert isinstance(final["detok"], RequestFailed) and "planted detokenizer bug" in final["detok"].message
    assert isinstance(final["fine"], RequestDone) and final["fine"].output["text"] == "ok"
    # Only bad input is a 400 (RequestError): any other error, a ValueError included, is the engine's (a 500).
    assert isinstance(final["value_bug"], RequestFailed) and "planted invariant" in final["value_bug"].message
    assert isinstance(final["internal"], RequestFailed) and "planted internal error" in final["internal"].message


def test_one_line_reason():
    assert one_line("Traceback (most recent call last):\n  File x\nValueError: y") == "Traceback (most recent call last):"
    assert len(one_line("x" * 1000)) == 300


# ---------------------------------------------------------------- the engine heartbeat


def test_heartbeat_stops_while_the_serving_loop_is_stuck():
    import threading
    import time

    from specserve.engine.messages import Heartbeat
    from specserve.server.engine_process import _beat

    events, stop, stuck = queue.Queue(), threading.Event(), threading.Event()
    beat = threading.Thread(target=_beat, args=(events, 0.01, stop, stuck.is_set))
    beat.start()
    time.sleep(0.1)
    stuck.set()
    time.sleep(0.05)
    while not events.empty():  # drain what was sent before (and while) it got stuck
        events.get()
    time.sleep(0.1)
    stop.set()
    beat.join()
    assert events.empty()  # no heartbeat while stuck
    beats = _count_beats(0.01, stalled=lambda: False)
    assert beats and all(isinstance(ev, Heartbeat) for ev in beats)


def _count_beats(interval, stalled):
    import threading
    import time

    from specserve.server.engine_process import _beat

    events, stop = queue.Queue(), threading.Event()
    beat = threading.Thread(target=_beat, args=(events, interval, stop, stalled))
    beat.start()
    time.sleep(0.1)
    stop.set()
    beat.join()
    return [ev for _ in range(events.qsize()) for ev in events.get()]


def test_engine_server_reports_a_stalled_iteration():
    server = EngineServer(_Engine(), queue.Queue(), queue.Queue())
    assert not server.stalled(60)
    server._iteration_started -= 61
    assert server.stalled(60)
