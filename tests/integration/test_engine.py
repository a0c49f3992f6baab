"""End-to-end behaviour of the Engine on the real model (float32 unless noted)."""

from __future__ import annotations

import pytest
from helpers import CHAT_PROMPTS

from specserve import Engine

GREEDY = {"temperature": 0, "max_new_tokens": 32}
TOPICS = ["a lighthouse keeper", "the history of tea", "how vaccines work", "a cat who can fly",
          "the rules of chess", "volcanoes", "a trip to Mars", "the invention of paper"]


def _chat(engine, text: str) -> list[int]:
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": text}])


def _batch_prompts(engine) -> list[list[int]]:
    # Eight prompts of clearly different lengths.
    return [_chat(engine, f"Tell me about {t}." + " Please be thorough." * i) for i, t in enumerate(TOPICS)]


def test_batch_invariance_fp32(checked):
    engine = checked
    prompts = _batch_prompts(engine)
    alone = [engine.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in prompts]
    engine.scheduler.ledger.tree.reset()
    together = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=GREEDY)]
    assert together == alone


@pytest.fixture(scope="module")
def chunked_engine():
    engine = Engine(dtype="float32", max_total_tokens=8192, chunked_prefill_size=16, max_prefill_tokens=48,
                    disable_radix_cache=True, speculative_algorithm="NONE")
    yield engine
    engine.scheduler.check_integrity()


def test_batch_invariance_with_chunked_prefill(checked, chunked_engine):
    prompts = _batch_prompts(checked)
    assert max(len(p) for p in prompts) > 3 * 16, "prompts must span several chunks"
    reference = [o["output_ids"] for o in checked.generate(input_ids=prompts, sampling_params=GREEDY)]
    chunked = [o["output_ids"] for o in chunked_engine.generate(input_ids=prompts, sampling_params=GREEDY)]
    assert chunked == reference
    alone = chunked_engine.generate(input_ids=prompts[-1], sampling_params=GREEDY)["output_ids"]
    assert alone == reference[-1]
    chunked_engine.scheduler.check_integrity()
    assert chunked_engine.scheduler.ledger.allocator.available == chunked_engine.scheduler.ledger.allocator.size


def test_radix_cache_shares_prefix_and_keeps_outputs(checked, chunked_engine):
    system = "You are a meticulous assistant. " * 20
    prompts = [checked.tokenizer.apply_chat_template([{"role": "system", "content": system},
                                                      {"role": "user", "content": f"Describe {t} briefly."}])
               for t in TOPICS[:4]]
    checked.scheduler.ledger.tree.reset()
    first = checked.generate(input_ids=prompts[0], sampling_params=GREEDY)
    rest = checked.generate(input_ids=prompts[1:], sampling_params=GREEDY)
    assert first["meta_info"]["cached_tokens"] == 0
    shared = len(checked.tokenizer.apply_chat_template([{"role": "system", "content": system}], add_generation_prompt=False))
    for out in rest:
        assert out["meta_info"]["cached_tokens"] >= shared
    again = checked.generate(input_ids=prompts[0], sampling_params=GREEDY)
    assert again["meta_info"]["cached_tokens"] == len(prompts[0]) - 1  # always recompute one token
    uncached = chunked_engine.generate(input_ids=prompts, sampling_params=GREEDY)  # radix disabled there
    assert all(o["meta_info"]["cached_tokens"] == 0 for o in uncached)
    assert [o["output_ids"] for o in uncached] == [first["output_ids"]] + [o["output_ids"] for o in rest]
    assert again["output_ids"] == first["output_ids"]


def test_memory_pressure_64_requests_through_small_pool(checked):
    prompts = [_chat(checked, f"Question {i}: name a color and a number.") for i in range(64)]
    params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    per_request = max(len(p) for p in prompts) + 12
    reference = [o["output_ids"] for o in checked.generate(input_ids=prompts, sampling_params=params)]
    small = Engine(dtype="float32", max_total_tokens=8 * per_request, disable_radix_cache=False,
                   speculative_algorithm="NONE")
    outs = small.generate(input_ids=prompts, sampling_params=params)
    assert [o["output_ids"] for o in outs] == reference
    small.scheduler.check_integrity()
    small.scheduler.ledger.tree.reset()
    assert small.scheduler.ledger.allocator.available == small.scheduler.ledger.allocator.size
    assert small.runner.req_to_token.available == small.args.max_running_requests + 1


def test_seeded_sampling_is_reproducible(checked):
    prompt = _chat(checked, CHAT_PROMPTS[1])
    params = {"temperature": 0.9, "top_p": 0.95, "top_k": 50, "seed": 1234, "max_new_tokens": 24}
    a = checked.generate(input_ids=prompt, sampling_params=params)["output_ids"]
    b = checked.generate(input_ids=[prompt, _chat(checked, "hi")], sampling_params=params)[0]["output_ids"]
    c = checked.generate(input_ids=prompt, sampling_params={**params, "seed": 99})["output_ids"]
    assert a == b, "same seed, alone and in a batch"
    assert a != c, "another seed samples another continuation"


def test_stop_string_cuts_text_exactly(checked):
    prompt = "1, 2, 3, 4, 5, 6, 7, 8,"
    full = checked.generate(prompt, sampling_params={"temperature": 0, "max_new_tokens": 16})["text"]
    assert " 10" in full, full
    out = checked.generate(prompt, sampling_params={"temperature": 0, "max_new_tokens": 16, "stop": [" 10"]})
    assert out["text"] == full[:full.index(" 10")]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": " 10"}


def test_stop_token_ids_and_max_new_tokens(checked):
    prompt = "1, 2, 3, 4, 5, 6, 7, 8,"
    base = checked.generate(prompt, sampling_params={"temperature": 0, "max_new_tokens": 8})
    stop_id = base["output_ids"][3]
    out = checked.generate(prompt, sampling_params={"temperature": 0, "max_new_tokens": 8, "stop_token_ids": [stop_id]})
    assert out["output_ids"] == base["output_ids"][:base["output_ids"].index(stop_id) + 1]
    assert out["meta_info"]["finish_reason"]["matched"] == stop_id
    assert base["meta_info"]["finish_reason"]["type"] == "length"
    assert base["meta_info"]["completion_tokens"] == 8
    zero = checked.generate(prompt, sampling_params={"max_new_tokens": 0})
    assert zero["output_ids"] == [] and zero["meta_info"]["finish_reason"]["type"] == "length"


@pytest.mark.parametrize("kwargs, field", [
    ({"prompt": ""}, "prompt"),
    ({"prompt": "hi", "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
    ({"prompt": "hi", "sampling_params": {"top_p": 0}}, "top_p"),
    ({"prompt": "hi", "sampling_params": {"top_p": 1.5}}, "top_p"),
    ({"prompt": "hi", "sampling_params": {"temprature": 0.5}}, "unknown key"),
    ({"prompt": "hi", "sampling_params": {"top_k": 0}}, "top_k"),
    ({"input_ids": [[1, 2, 10**9]]}, "input_ids"),
    ({"input_ids": []}, "input_ids"),
])
def test_bad_input_raises_and_engine_keeps_serving(checked, kwargs, field):
    with pytest.raises(ValueError, match=field):
        checked.generate(**kwargs)
    ok = checked.generate("Hello", sampling_params={"temperature": 0, "max_new_tokens": 4})
    assert ok["meta_info"]["completion_tokens"] == 4


def test_prompt_longer_than_context_is_rejected(checked):
    too_long = [1] * checked.model.context_length
    with pytest.raises(ValueError, match="context window"):
        checked.generate(input_ids=too_long)
    with pytest.raises(ValueError, match="prompt"):
        checked.generate(input_ids=[too_long[:10], too_long])  # one bad prompt rejects the batch before queueing
    assert not checked.scheduler.has_work()


def test_bad_engine_arguments():
    with pytest.raises(ValueError, match="model_path"):
        Engine(model_path="/does/not/exist")
    with pytest.raises(ValueError, match="unknown engine argument"):
        Engine(dtyp="float32")
    with pytest.raises(ValueError, match="schedule_policy"):
        Engine(schedule_policy="random")


def test_not_llama_family_is_rejected(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(ValueError, match="llama-family"):
        Engine(model_path=str(tmp_path))


@pytest.mark.parametrize("policy", ["lpm", "shortest-prefill-first"])
def test_policies_give_the_same_greedy_outputs(checked, policy):
    prompts = _batch_prompts(checked)[:4]
    reference = [o["output_ids"] for o in checked.generate(input_ids=prompts, sampling_params=GREEDY)]
    other = Engine(dtype="float32", max_total_tokens=4096, schedule_policy=policy, speculative_algorithm="NONE")
    assert [o["output_ids"] for o in other.generate(input_ids=prompts, sampling_params=GREEDY)] == reference
    other.scheduler.check_integrity()


# ---------------------------------------------------------------- validation once, at the boundary


@pytest.fixture
def parse_counts(monkeypatch):
    """Spies (calling through) on every parse and validation of sampling params and every grammar compile."""
    import specserve.logits.grammar as grammar
    from specserve.sampling_params import SamplingParams

    counts = {"from_dict": 0, "validate": 0, "compile": 0}

    def counting(name, fn):
        def spy(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return spy

    monkeypatch.setattr(SamplingParams, "from_dict", classmethod(counting("from_dict", SamplingParams.from_dict.__func__)))
    monkeypatch.setattr(SamplingParams, "validate", counting("validate", SamplingParams.validate))
    monkeypatch.setattr(grammar, "grammar_text", counting("compile", grammar.grammar_text))
    return counts


def test_the_offline_api_parses_validates_and_compiles_a_request_once(checked, parse_counts):
    params = {"temperature": 0, "max_new_tokens": 6, "regex": "[0-9]{1,3}( [0-9]{1,3}){0,7} offline"}
    out = checked.generate("Count: 1 2 3", sampling_params=params)
    assert out["meta_info"]["completion_tokens"] > 0
    assert parse_counts == {"from_dict": 1, "validate": 1, "compile": 1}


def test_the_serving_path_parses_in_the_route_and_compiles_in_the_engine_once(checked, parse_counts):
    """The route's parse (in the HTTP process), the typed AddRequest pickled across the queue as the
    engine process gets it, and the real EngineServer over the real engine: one of each in all."""
    import pickle
    import queue
    import threading
    from types import SimpleNamespace

    from specserve.engine.messages import AddRequest, RequestDone, Shutdown
    from specserve.server.engine_process import EngineServer
    from specserve.server.routes import _parse_params

    state = SimpleNamespace(client=SimpleNamespace(info={"vocab_size": checked.model.config.vocab_size}))
    raw = {"temperature": 0, "max_new_tokens": 6, "regex": "[0-9]{1,3}( [0-9]{1,3}){0,7} served"}
    params = _parse_params(state, raw, {})
    commands, events = queue.Queue(), queue.Queue()
    commands.put(pickle.loads(pickle.dumps(AddRequest("served-1", checked.tokenizer.encode("Count: 1 2 3"), params))))
    server = EngineServer(checked, commands, events)
    loop = threading.Thread(target=server.run)
    loop.start()
    done = None
    while done is None:
        done = next((ev for ev in events.get(timeout=120) if isinstance(ev, RequestDone)), None)
    commands.put(Shutdown())
    loop.join(60)
    assert done.rid == "served-1" and done.output["meta_info"]["completion_tokens"] > 0
    assert parse_counts == {"from_dict": 1, "validate": 1, "compile": 1}
