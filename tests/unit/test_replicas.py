"""`serve --dp-size`: each replica's command line, the flag checks, and the SGLang extensions the
router adds to every request (accepted at their one supported value, a 400 naming them otherwise)."""

from __future__ import annotations

import dataclasses

import pytest
from pydantic import ValidationError

from specserve.args import ServerArgs
from specserve.cli import build_parser
from specserve.flag_bounds import check_flag_bounds
from specserve.server.errors import from_validation_errors
from specserve.server.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest
from specserve.server.replicas import check_data_parallel_args, replica_argv


def parse(*argv: str):
    ns = build_parser().parse_args(["serve", *argv])
    check_flag_bounds(ns)
    return ns, ServerArgs.from_cli_args(ns)


def test_a_replica_gets_the_engine_and_server_flags_its_port_and_its_thread_share():
    ns, _ = parse("--dp-size", "2", "--port", "8000", "--host", "0.0.0.0", "--dtype", "float32",
                  "--enable-hierarchical-cache", "--api-key", "k", "--speculative-algorithm", "NONE",
                  "--router-policy", "round_robin")
    argv = replica_argv(ns, 41234, threads=1)
    joined = " ".join(argv)
    assert argv[argv.index("--port") + 1] == "41234" and argv[argv.index("--host") + 1] == "127.0.0.1"
    assert "--dtype float32" in joined and "--enable-hierarchical-cache" in argv and "--api-key k" in joined
    assert "--speculative-algorithm NONE" in joined and "--num-threads 1" in joined
    assert "--dp-size" not in argv and "--router-policy" not in argv and "0.0.0.0" not in argv
    ns, _ = parse("--dp-size", "2", "--num-threads", "3")
    assert "--num-threads 3" in " ".join(replica_argv(ns, 1, threads=1))  # the user's choice wins


def test_the_replica_command_parses_back_to_the_same_engine_settings():
    ns, args = parse("--dp-size", "2", "--dtype", "float32", "--max-total-tokens", "4096", "--hicache-ratio", "3")
    argv = replica_argv(ns, 5000, threads=2)
    replica_ns, replica_args = parse(*argv[argv.index("serve") + 1:])
    assert replica_args == dataclasses.replace(args, num_threads=2)
    assert replica_ns.dp_size == 1


@pytest.mark.parametrize("argv, message", [
    (("--dp-size", "2", "--dist-init-addr", "127.0.0.1:5000"), "--dist-init-addr"),
    (("--dp-size", "2", "--tp-size", "2", "--nnodes", "2", "--dist-init-addr", "10.0.0.1:5000"), "--dp-size"),
])
def test_flags_that_cannot_work_with_replicas_are_refused(argv, message):
    ns, args = parse(*argv)
    with pytest.raises(ValueError, match=message):
        check_data_parallel_args(ns, args)


def test_dp_size_must_be_positive():
    with pytest.raises(ValueError, match="--dp-size must be >= 1"):
        parse("--dp-size", "0")


ROUTER_CHAT_FIELDS = {"logprobs": False, "stream": False, "no_stop_trim": False, "ignore_eos": False,
                      "continue_final_message": False, "skip_special_tokens": True, "separate_reasoning": True,
                      "stream_reasoning": True, "return_hidden_states": False}
ROUTER_GENERATE_FIELDS = {"model": None, "return_text_in_logprobs": False, "stream": False, "log_metrics": True,
                          "return_hidden_states": False, "background": False, "no_logs": False,
                          "return_bytes": False, "return_entropy": False}


def test_what_the_router_forwards_is_accepted():
    ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                          **ROUTER_CHAT_FIELDS})
    CompletionRequest.model_validate({"model": "m", "prompt": "hi", "echo": False, "no_stop_trim": False,
                                      "ignore_eos": False, "skip_special_tokens": True, "return_hidden_states": False})
    GenerateRequest.model_validate({"text": "hi", "sampling_params": {"max_new_tokens": 4}, **ROUTER_GENERATE_FIELDS})


@pytest.mark.parametrize("model, field, value", [
    (ChatCompletionRequest, "no_stop_trim", True), (ChatCompletionRequest, "continue_final_message", True),
    (ChatCompletionRequest, "skip_special_tokens", False), (CompletionRequest, "return_hidden_states", True),
    (GenerateRequest, "return_text_in_logprobs", True), (GenerateRequest, "background", True),
    (GenerateRequest, "log_metrics", False),
])
def test_an_unsupported_value_of_a_router_field_is_a_400_naming_it(model, field, value):
    base = {ChatCompletionRequest: {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
            CompletionRequest: {"model": "m", "prompt": "hi"}, GenerateRequest: {"text": "hi"}}[model]
    with pytest.raises(ValidationError) as caught:
        model.model_validate({**base, field: value})
    error = from_validation_errors(caught.value.errors())
    assert error.status == 400 and error.param == field and "only" in error.message


def test_every_server_flag_but_the_address_reaches_the_replicas():
    """A flag `specserve serve` adds for its HTTP side (the reasoning and tool-call parsers, limits,
    ...) that the launcher did not forward would silently not apply behind the router."""
    import argparse

    from specserve.server.launch import add_serve_args
    from specserve.server.replicas import FORWARDED_SERVE_FLAGS

    p = argparse.ArgumentParser()
    add_serve_args(p)
    server_flags = {a.dest for a in p._actions} - {"help", "host", "port"}
    assert server_flags <= set(FORWARDED_SERVE_FLAGS), sorted(server_flags - set(FORWARDED_SERVE_FLAGS))
    ns, _ = parse("--dp-size", "2", "--reasoning-parser", "qwen3", "--tool-call-parser", "llama3")
    joined = " ".join(replica_argv(ns, 1, threads=1))
    assert "--reasoning-parser qwen3" in joined and "--tool-call-parser llama3" in joined
