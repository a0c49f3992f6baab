"""What the tests of the real packaged GGUFs share: held-out texts for tokenizer parity and the
transformers references loaded from the same file."""

from __future__ import annotations

import os

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
