"""`python -m benchmarks grammar`: the grammar library's costs, and structured output under speculation.

Part 1, the library (no model): for llguidance and, when importable, XGrammar, on the same
schemas and tokenizer: schema compile time, the per-token mask time along a valid instance's
tokens, and coverage (which of a set of JSON-Schema features each compiles).
Part 2, the engine: the per-token overhead of grammar masks at batch 1 and 16 (NONE, with and
without a JSON schema), and DSPARK's accept length and tokens/s with and without the schema,
against NONE in the same run.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any, Callable, Optional

# JSON-Schema features, one small schema each; where a library might accept the keyword and not
# enforce it, an instance that breaks it (a library "enforces" a feature it compiles and rejects that with).
VIOLATIONS = {"uniqueItems": [1, 1], "not": "a", "if/then/else": "abcdef", "multipleOf": 7,
              "integer range": 98, "pattern": "abc-1", "string length": "abcdef", "const": "other"}
COVERAGE = {
    "nested objects": {"type": "object", "properties": {"a": {"type": "object", "properties": {
        "b": {"type": "integer"}}, "required": ["b"]}}, "required": ["a"]},
    "enum": {"enum": ["x", "y", "z"]},
    "const": {"const": "fixed"},
    "integer range": {"type": "integer", "minimum": 3, "maximum": 97},
    "number range": {"type": "number", "minimum": -1.5, "maximum": 2.5},
    "string length": {"type": "string", "minLength": 2, "maxLength": 5},
    "pattern": {"type": "string", "pattern": "^[a-z]{3}-[0-9]{2}$"},
    "format date-time": {"type": "string", "format": "date-time"},
    "format email": {"type": "string", "format": "email"},
    "array bounds": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 3},
    "uniqueItems": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    "prefixItems": {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}]},
    "anyOf": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
    "oneOf": {"oneOf": [{"type": "string"}, {"type": "boolean"}]},
    "allOf": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
                        {"required": ["a"]}]},
    "$ref/$defs": {"$defs": {"p": {"type": "object", "properties": {"n": {"type": "string"}}}},
                   "type": "object", "properties": {"p": {"$ref": "#/$defs/p"}}},
    "recursive $ref": {"$defs": {"t": {"type": "object", "properties": {"kids": {"type": "array", "items": {
        "$ref": "#/$defs/t"}}}}}, "$ref": "#/$defs/t"},
    "additionalProperties schema": {"type": "object", "additionalProperties": {"type": "integer"}},
    "patternProperties": {"type": "object", "patternProperties": {"^x_": {"type": "string"}}},
    "if/then/else": {"if": {"type": "string"}, "then": {"maxLength": 3}, "else": {"type": "integer"}},
    "multipleOf": {"type": "integer", "multipleOf": 5},
    "not": {"not": {"type": "string"}},
}


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """An object schema a 135M model finishes in 256 tokens: nested objects, enums, bounded strings
    and arrays, integer ranges, optional fields; every object closed (additionalProperties false)."""
    props, required = {}, []
    for i in range(rng.randint(1, 3)):
        name = rng.choice(["name", "id", "color", "size", "tags", "owner", "count", "kind", "score"]) + str(i)
        props[name] = _value_schema(rng, depth)
        if rng.random() < 0.7:
            required.append(name)
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def _value_schema(rng: random.Random, depth: int) -> dict:
    kind = rng.choice(["string", "integer", "enum", "boolean", "array"] + (["object"] if depth < 1 else []))
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(3, 10)}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(1, 500)}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "small", "large", "yes", "no"], rng.randint(2, 4))}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "array":
        return {"type": "array", "items": _value_schema(rng, 2), "maxItems": rng.randint(1, 3)}
    return random_schema(rng, depth + 1)


def instance_of(schema: dict) -> Any:
    """A valid instance of a random_schema (every property, the smallest values)."""
    if "enum" in schema:
        return schema["enum"][0]
    kind = schema["type"]
    if kind == "object":
        return {k: instance_of(v) for k, v in schema["properties"].items()}
    if kind == "array":
        return [instance_of(schema["items"])]
    if kind == "string":
        return "abc"[:schema.get("maxLength", 3)]
    if kind == "integer":
        return schema["minimum"]
    return True


def add_grammar_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--schemas", type=int, default=50, help="generated schemas")
    p.add_argument("--prompts", type=int, default=16, help="structured prompts for the engine part (batch 16)")
    p.add_argument("--max-new-tokens", type=int, default=192)
    p.add_argument("--skip-engine", action="store_true", help="only the library comparison")
    p.add_argument("--out", default=None, help="write the results as JSON here")


def run_grammar_bench(ns: argparse.Namespace) -> int:
    from specserve.bench.provenance import provenance
    from specserve.models.loader import default_model_path
    from specserve.tokenizer.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(default_model_path())
    rng = random.Random(18)
    schemas = [random_schema(rng) for _ in range(ns.schemas)]
    results: dict[str, Any] = {**provenance(), "schemas": ns.schemas, "libraries": {}}
    for name, make in (("llguidance", _llguidance), ("xgrammar", _xgrammar)):
        backend = make(tokenizer)
        results["libraries"][name] = _library(backend, tokenizer, schemas) if backend else {"available": False}
        print(json.dumps({name: results["libraries"][name]}), flush=True)
    if not ns.skip_engine:
        results["engine"] = _engine_part(ns, schemas)
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


# ------------------------------------------------------------------ part 1: the libraries

class _Backend:
    """compile(schema) -> matcher; mask(matcher) computes the next-token mask; consume(matcher, token)
    -> accepted; complete(matcher) -> whether what was consumed is a whole valid value."""

    def __init__(self, compile: Callable, mask: Callable, consume: Callable, complete: Callable):
        self.compile, self.mask, self.consume, self.complete = compile, mask, consume, complete

    def accepts(self, schema: dict, value: Any, tokenizer) -> bool:
        matcher = self.compile(schema)
        tokens = tokenizer.encode(json.dumps(value), add_special_tokens=False)
        return all(self.consume(matcher, t) for t in tokens) and self.complete(matcher)


def _llguidance(tokenizer) -> _Backend:
    import llguidance

    from specserve.logits.grammar import JSON_OPTIONS

    llt = llguidance.LLTokenizer(tokenizer.backend.to_str(), eos_token=list(tokenizer.eos_token_ids))

    def compile(schema: dict):
        matcher = llguidance.LLMatcher(llt, llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults=JSON_OPTIONS), log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    return _Backend(compile, lambda m: m.compute_bitmask(), lambda m, t: m.consume_token(t),
                    lambda m: m.is_accepting())


def _xgrammar(tokenizer) -> Optional[_Backend]:
    try:
        import xgrammar
    except ImportError:
        return None
    vocab = [tokenizer.id_to_token(i) or "" for i in range(tokenizer.vocab_size)]
    info = xgrammar.TokenizerInfo(vocab, xgrammar.VocabType.BYTE_LEVEL, vocab_size=tokenizer.vocab_size,
                                  stop_token_ids=list(tokenizer.eos_token_ids))
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    bitmask = xgrammar.allocate_token_bitmask(1, tokenizer.vocab_size)

    def compile(schema: dict):
        return xgrammar.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                                    separators=(", ", ": ")))

    eos = tokenizer.eos_token_ids[0]
    return _Backend(compile, lambda m: m.fill_next_token_bitmask(bitmask), lambda m, t: m.accept_token(t),
                    lambda m: m.accept_token(eos))


def _library(backend: _Backend, tokenizer, schemas: list[dict]) -> dict[str, Any]:
    compile_ms, mask_ms, failed = [], [], []
    for schema in schemas:
        start = time.perf_counter()
        matcher = backend.compile(schema)
        compile_ms.append((time.perf_counter() - start) * 1e3)
        for token in tokenizer.encode(json.dumps(instance_of(schema)), add_special_tokens=False):
            start = time.perf_counter()
            backend.mask(matcher)
            mask_ms.append((time.perf_counter() - start) * 1e3)
            if not backend.consume(matcher, token):
                failed.append(json.dumps(schema)[:80])
                break
    covered, enforced = {}, {}
    for feature, schema in COVERAGE.items():
        try:
            backend.compile(schema)
            covered[feature] = True
        except Exception:  # each library raises its own type for what it does not support
            covered[feature] = False
        enforced[feature] = covered[feature] and (feature not in VIOLATIONS or not backend.accepts(
            schema, VIOLATIONS[feature], tokenizer))
    return {"available": True, "compile_ms_median": round(statistics.median(compile_ms), 3),
            "compile_ms_max": round(max(compile_ms), 3), "mask_ms_per_token": round(statistics.mean(mask_ms), 4),
            "mask_ms_p99": round(sorted(mask_ms)[int(0.99 * (len(mask_ms) - 1))], 4), "tokens_walked": len(mask_ms),
            "instances_rejected": len(failed), "compiles": f"{sum(covered.values())}/{len(covered)}",
            "enforces": f"{sum(enforced.values())}/{len(enforced)}",
            "accepted_but_not_enforced": sorted(f for f in covered if covered[f] and not enforced[f]),
            "features": covered}


# ------------------------------------------------------------------ part 2: the engine

def _engine_part(ns: argparse.Namespace, schemas: list[dict]) -> dict[str, Any]:
    from specserve.engine import Engine

    out: dict[str, Any] = {}
    for alg in ("NONE", "DSPARK"):
        with Engine(speculative_algorithm=alg, random_seed=0) as engine:
            prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": c}]) for c in _contents(ns)]
            # warm up, a grammar included (the first one builds llguidance's tokenizer, ~0.2 s)
            engine.generate(input_ids=prompts[:2], sampling_params={"max_new_tokens": 8, "json_schema": "{}"})
            for batch in (1, ns.prompts):
                # the schema run first: the free run then generates exactly as many tokens per prompt
                # (ignore_eos), so both spend the same prefill and the same number of decode rows
                constrained = _run(engine, prompts, schemas, batch, None, ns.max_new_tokens)
                out[f"{alg} batch {batch} schema"] = constrained
                out[f"{alg} batch {batch} free"] = _run(engine, prompts, schemas, batch, constrained.pop("lengths"),
                                                        ns.max_new_tokens)
                out[f"{alg} batch {batch} free"].pop("lengths")
                print(json.dumps({alg: batch}), flush=True)
    for batch in (1, ns.prompts):
        none_free, none_schema = out[f"NONE batch {batch} free"], out[f"NONE batch {batch} schema"]
        out[f"batch {batch}"] = {
            "mask_overhead_ms_per_token": round(none_schema["ms_per_token"] - none_free["ms_per_token"], 3),
            "dspark_vs_none_free": round(out[f"DSPARK batch {batch} free"]["tokens_per_s"] / none_free["tokens_per_s"], 3),
            "dspark_vs_none_schema": round(out[f"DSPARK batch {batch} schema"]["tokens_per_s"]
                                           / none_schema["tokens_per_s"], 3)}
        print(json.dumps({f"batch {batch}": out[f"batch {batch}"]}), flush=True)
    return out


def _contents(ns: argparse.Namespace) -> list[str]:
    things = ["a web shop order", "a library book", "a weather report", "a user profile", "a recipe", "a car",
              "a city", "a movie", "a song", "a football match", "a hotel room", "a train ticket", "a pet",
              "a laptop", "a painting", "a flight"]
    return [f"Reply with one JSON object describing {things[i % len(things)]}." for i in range(ns.prompts)]


def _run(engine, prompts: list[list[int]], schemas: list[dict], batch: int, free_lengths: Optional[dict[int, int]],
         max_new_tokens: int) -> dict[str, Any]:
    """Greedy; batch 1 runs 4 prompts one after another. `free_lengths` None: each prompt under its
    schema; else free text of exactly those lengths per prompt."""
    chosen = list(range(4)) if batch == 1 else list(range(batch))
    tokens = verify = accepted = 0
    lengths: dict[int, int] = {}
    start = time.perf_counter()
    for group in ([[i] for i in chosen] if batch == 1 else [chosen]):
        params = [{"temperature": 0, "max_new_tokens": max_new_tokens, "json_schema": json.dumps(schemas[i])}
                  if free_lengths is None else {"temperature": 0, "max_new_tokens": free_lengths[i], "ignore_eos": True}
                  for i in group]
        for i, o in zip(group, engine.generate(input_ids=[prompts[i] for i in group], sampling_params=params)):
            lengths[i] = o["meta_info"]["completion_tokens"]
            tokens += o["meta_info"]["completion_tokens"]
            verify += o["meta_info"].get("spec_verify_ct", 0)
            accepted += o["meta_info"].get("spec_num_correct_drafts", 0)
    seconds = time.perf_counter() - start
    result = {"tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 2),
              "ms_per_token": round(1e3 * seconds / max(tokens, 1), 3), "lengths": lengths}
    if verify:
        result["accept_length"] = round(1 + accepted / verify, 3)
    return result
