"""Logprobs, penalties and logit bias through the live server (the official `openai` client and
the native /generate), on the default speculating engine."""

from __future__ import annotations

import httpx
import pytest

from helpers import MODEL

PROMPT = "Name three primary colors."
LONG = {"max_tokens": 16, "temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def tokenizer():
    from specserve.models.loader import default_model_path
    from specserve.tokenizer.tokenizer import load_tokenizer

    return load_tokenizer(default_model_path())


def _chat(client, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}], **kw)


def test_chat_logprobs_cover_every_token_with_sorted_alternatives(client, tokenizer):
    resp = _chat(client, logprobs=True, top_logprobs=3, **LONG)
    choice = resp.choices[0]
    content = choice.logprobs.content
    assert len(content) == resp.usage.completion_tokens == 16  # every output token, EOS included
    special = {tokenizer.id_to_token(t) for t in range(tokenizer.vocab_size) if tokenizer.is_special(t)}
    text = bytes(b for c in content if c.token not in special for b in c.bytes).decode()
    assert text == choice.message.content
    for entry in content:
        values = [t.logprob for t in entry.top_logprobs]
        assert len(values) == 3 and values == sorted(values, reverse=True)
        assert entry.top_logprobs[0].token == entry.token  # greedy: the chosen token is the top one
        assert entry.logprob == pytest.approx(values[0], abs=1e-6) and entry.logprob <= 0
    assert _chat(client, **LONG).choices[0].logprobs is None  # only when asked


def test_streamed_logprobs_reassemble_to_the_non_streamed(client):
    whole = _chat(client, logprobs=True, top_logprobs=2, **LONG).choices[0].logprobs.content
    chunks = list(_chat(client, logprobs=True, top_logprobs=2, stream=True, **LONG))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in whole]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in whole], abs=1e-3)


def test_completion_logprobs_are_the_legacy_lists(client):
    resp = client.completions.create(model=MODEL, prompt="The capital of France is", logprobs=2, max_tokens=8,
                                     temperature=0, extra_body={"ignore_eos": True})
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    assert "".join(lp.tokens) == resp.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) <= 2 and max(top.values()) == pytest.approx(value, abs=1e-6)


def test_logit_bias_bans_the_greedy_token_and_penalties_are_served(client, server, auth, tokenizer):
    ids = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}])
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 4, "temperature": 0}, "return_logprob": True,
            "top_logprobs_num": 2, "logprob_start_len": 0}
    plain = httpx.post(server.url + "/generate", json=body, headers=auth, timeout=120).json()
    meta = plain["meta_info"]
    assert [t for _, t, _ in meta["input_token_logprobs"]] == ids and meta["input_token_logprobs"][0][0] is None
    assert [t for _, t, _ in meta["output_token_logprobs"]] == plain["output_ids"]
    assert all(len(top) == 2 and top[0][1] == t for top, t in zip(meta["output_top_logprobs"], plain["output_ids"]))
    first = plain["output_ids"][0]
    banned = _chat(client, max_tokens=4, temperature=0, logit_bias={str(first): -100}, logprobs=True)
    assert banned.choices[0].logprobs.content[0].bytes != list(tokenizer.token_bytes(first))
    penalised = _chat(client, max_tokens=8, temperature=0, presence_penalty=1.5, frequency_penalty=1.0,
                      extra_body={"repetition_penalty": 1.2})
    assert penalised.choices[0].finish_reason in ("stop", "length") and penalised.usage.completion_tokens > 0


def test_echo_puts_the_prompt_and_its_logprobs_first_streamed_or_not(client):
    kw = dict(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0, echo=True, logprobs=1,
              extra_body={"ignore_eos": True})
    resp = client.completions.create(**kw)
    choice, prompt_tokens = resp.choices[0], resp.usage.prompt_tokens
    assert choice.text.startswith("The capital of France is")
    lp = choice.logprobs
    assert len(lp.tokens) == prompt_tokens + 4 and "".join(lp.tokens) == choice.text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    chunks = [c for c in client.completions.create(stream=True, **kw) if c.choices]
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    streamed = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert streamed == lp.tokens
    plain = client.completions.create(**{**kw, "logprobs": None})
    assert plain.choices[0].text == choice.text and plain.choices[0].logprobs is None
