"""Bad requests get precise 4xx answers and leave the server serving; disconnects free KV; metrics parse."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from helpers import MODEL


CHAT = "/v1/chat/completions"


def ok_body(**kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, **kw}


@pytest.fixture(scope="module")
def http(server, auth):
    with httpx.Client(base_url=server.url, headers=auth, timeout=120) as c:
        yield c


def metrics(http) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = http.get("/metrics").text
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples if not s.labels}


def labelled(http, name: str) -> dict[str, float]:
    """A counter's samples by their one label's value."""
    from prometheus_client.parser import text_string_to_metric_families

    text = http.get("/metrics").text
    return {next(iter(s.labels.values())): s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name == name and s.labels}


@pytest.mark.parametrize("body, status, param", [
    (b"{not json", 400, None),
    (json.dumps(ok_body(max_tokens="four")).encode(), 400, "max_tokens"),
    (json.dumps(ok_body(max_tokens=-1)).encode(), 400, "max_tokens"),
    (json.dumps(ok_body(temperature=-0.5)).encode(), 400, "temperature"),
    (json.dumps(ok_body(n=0)).encode(), 400, "n"),
    (json.dumps(ok_body(messages="hi")).encode(), 400, "messages"),
    (json.dumps(ok_body(frobnicate=True)).encode(), 400, "frobnicate"),
    (json.dumps(ok_body(presence_penalty=2.5)).encode(), 400, "presence_penalty"),
    (json.dumps(ok_body(logit_bias={"99999999": 1})).encode(), 400, "logit_bias"),
    (json.dumps(ok_body(top_logprobs=2)).encode(), 400, "top_logprobs"),
    (json.dumps(ok_body(model="gpt-4")).encode(), 404, "model"),
    (json.dumps({**ok_body(), "messages": [{"role": "user", "content": "word " * 9000}]}).encode(), 400, "messages"),
])
def test_bad_request_answers_4xx_and_server_keeps_serving(http, body, status, param):
    r = http.post(CHAT, content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    if param is not None:
        assert err["param"] == param and param in err["message"]
    assert http.get("/health").status_code == 200
    assert http.post(CHAT, json=ok_body()).status_code == 200


def test_huge_prompt_names_the_context_window(http):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "word " * 9000, "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_sampling_param_validation_reaches_the_client(http):
    r = http.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "top_p": 7}})
    assert r.status_code == 400 and "top_p" in r.json()["error"]["message"]
    r = http.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 3}})
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 3


def test_api_key_is_required(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(server.url + CHAT, json=ok_body(), headers=headers, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200  # health stays open


def test_disconnect_mid_stream_frees_kv(http):
    body = ok_body(max_tokens=3000, stream=True, ignore_eos=True,
                   messages=[{"role": "user", "content": "Write a very long essay about rivers."}])
    with http.stream("POST", CHAT, json=body) as r:
        assert r.status_code == 200
        received = 0
        for line in r.iter_lines():
            received += line.startswith("data: ")
            if received >= 5:
                break  # the client goes away with ~3000 tokens still to generate
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m = metrics(http)
        if m["specserve_kv_request_tokens"] == 0 and m["specserve_num_requests_running"] == 0:
            break
        time.sleep(0.2)
    m = metrics(http)
    assert m["specserve_kv_request_tokens"] == 0, m
    assert m["specserve_num_requests_running"] == 0 and m["specserve_num_requests_waiting"] == 0


def test_a_client_gone_before_the_first_byte_aborts_its_request(http):
    """A streamed request whose client leaves while its long prompt prefills (no byte sent yet)
    is aborted then, without waiting for a first token to start the response."""
    body = {"model": MODEL, "prompt": "word " * 6000, "max_tokens": 3000, "stream": True, "ignore_eos": True}
    before = labelled(http, "specserve_request_finished_total").get("abort", 0)
    tokens_before = metrics(http)["specserve_generation_tokens_total"]
    with pytest.raises(httpx.ReadTimeout):
        with http.stream("POST", "/v1/completions", json=body, timeout=httpx.Timeout(120, read=0.5)) as r:
            r.read()
    deadline = time.monotonic() + 60
    while labelled(http, "specserve_request_finished_total").get("abort", 0) == before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert labelled(http, "specserve_request_finished_total").get("abort", 0) == before + 1
    # Aborted while prefilling (seconds of work for 6000 tokens on any CPU), not once a first token
    # had started the response: then the stream's own disconnect check would have caught it.
    assert metrics(http)["specserve_generation_tokens_total"] == tokens_before


def test_metrics_parse_and_carry_speculative_statistics(http):
    assert http.post(CHAT, json=ok_body(max_tokens=16)).status_code == 200
    m = metrics(http)
    assert m["specserve_spec_accept_length_count"] >= 1
    assert m["specserve_spec_correct_drafts_count"] >= m["specserve_spec_accept_length_count"]
    # The policy's decisions: drafts per request-step (0 included) cover at least the verify steps,
    # a prediction per request that speculated, and the cost model's residual once it has seen steps.
    assert m["specserve_spec_draft_len_count"] >= m["specserve_spec_correct_drafts_count"]
    assert m["specserve_spec_predicted_accept_length_count"] >= 1
    assert m["specserve_spec_cost_model_residual"] > 0
    drafters = labelled(http, "specserve_spec_drafter_steps_total")
    assert drafters and set(drafters) <= {"DSPARK", "NGRAM", "SUFFIX"} and sum(drafters.values()) >= 1
    assert m["specserve_generation_tokens_total"] >= 16
    assert m["specserve_time_to_first_token_seconds_count"] >= 1
    assert 0 < m["specserve_kv_total_tokens"]
