"""What the tests of the real packaged GGUFs share: held-out texts for tokenizer parity and the
transformers references loaded from the same file."""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

import pytest
import torch

from specserve.datasets import humaneval_prompts, sharegpt_first_turns

EDGE_TEXTS = [
    "naïve café 日本語 😀👍🏽 ÄÖÜ ß",
    "   lots   of   spaces\t\ttabs\r\nCRLF\n\n\n  \n",
    " leading space and trailing  ",
    "12345678 + 99 = 1e-9 * 0x1F",
    "I'm you're WE'LL they'd",
    "x=1;y=2;print(x+y)  # sum",
    "def f(x):\n\tif x:\n\t\treturn {'a': [1, 2]}\n",
    "\u200b zero width \U0001f600\U0001f600",
]


def held_out_texts(specials: list[str]) -> list[str]:
    """256 texts: ShareGPT turns, HumanEval prompts, edge cases, and the model's special tokens in text."""
    return (
        sharegpt_first_turns(147, seed=7)
        + [p["prompt"] for p in humaneval_prompts()[:100]]
        + EDGE_TEXTS
        + ["".join(specials) + " and text around " + " ".join(specials)]
    )


@contextlib.contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """transformers parses a GGUF with the `gguf` package's GGUFReader for its config, again for its
    weights and again for its tokenizer, each time from scratch (about 20 s per parse of these
    files' vocabularies, element by element); within this context each file is parsed once and
    its reader handed out again. transformers still reads the file with its own parser."""
    import gguf

    real, readers = gguf.GGUFReader, {}

    def reader(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = real(path, mode)
        return readers[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", reader)
        yield


def transformers_tokenizer(path: str):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def transformers_greedy(path: str, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers' float32 greedy continuation of each prompt, exactly `new_tokens` long (stop tokens
    included as plain tokens)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    ).eval()
    # No stop token, as the engine's ignore_eos (min_new_tokens would forbid EOS instead of passing it).
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        return [
            model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=new_tokens, pad_token_id=0)[
                0, len(ids):
            ].tolist()
            for ids in prompts
        ]


def perplexity_text() -> str:
    """Held-out prose and code (ShareGPT turns the tokenizer tests do not use, and a HumanEval prompt)."""
    return "\n\n".join(sharegpt_first_turns(160, seed=7)[150:156]) + "\n\n" + humaneval_prompts()[120]["prompt"]


def bf16_perplexity_ratio(bf16_engine, fp32_model, max_tokens: int = 384) -> float:
    """Perplexity of the model in bf16 (CPU kernels, the GGUF's codes) over that of `fp32_model`
    (dequantized weights) on the same held-out tokens, each computed in one prefill."""
    from helpers import prefill_logits

    def perplexity(model, ids: list[int]) -> float:
        logits = prefill_logits(model, ids)[:-1].float()
        return torch.exp(torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]))).item()

    ids = bf16_engine.tokenizer.encode(perplexity_text())[:max_tokens]
    return perplexity(bf16_engine.runner.model, ids) / perplexity(fp32_model, ids)


def check_auto_runs_int8_losslessly(path: str, bf16_engine, prompts: list[list[int]]) -> None:
    """A quantized file: the default (`--cpu-activations auto`, models/activations.py) runs int8
    activations, and NGRAM under them gives the tokens of plain int8 decoding (the bf16 engine's
    linears switched to int8, its prefix cache emptied on both sides of the switch: cached K/V hold
    the activations they were computed with)."""
    from helpers import int8_activations

    from specserve.engine import Engine

    params = {"temperature": 0, "max_new_tokens": 32}
    bf16_engine.scheduler.ledger.tree.reset()
    with int8_activations(bf16_engine.runner.model) as switched:
        assert switched > 0
        plain = [o["output_ids"] for o in bf16_engine.generate(input_ids=prompts, sampling_params=params)]
    bf16_engine.scheduler.ledger.tree.reset()
    with Engine(model_path=path, speculative_algorithm="NGRAM", max_total_tokens=4096) as engine:
        assert engine.args.cpu_activations == "int8"
        assert [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)] == plain
