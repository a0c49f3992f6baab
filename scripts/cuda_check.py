"""The engine's CUDA paths on a real GPU, in one short run: CUDA-graph replays, CUDA streams under the
overlap loop, the stream sanitizer, the stale-accept race, pinned-host HiCache, and the speed of each.

CPU-only CI never reaches these paths (the machines have no GPU); run this where a GPU is lent:

    python scripts/cuda_check.py --out cuda_check.json [--commit HASH]

The model is a tiny random llama written to a GGUF here (the repository's embedded model does not
fit the device tool's transfer limit), with a random DSpark drafter for it: these checks are about
streams, graphs and buffers, which do not depend on what the weights say. Greedy fp32 tokens must
be identical across every loop (overlap, sync), every step kind (captured graphs, eager) and every
algorithm (NONE, NGRAM, DSPARK); the sanitizer must stay silent on the real run and fire on the
planted alias fault; HiCache must bring an evicted prefix back from pinned host memory with the
same tokens. Every failed check is recorded and the script exits 1; nothing is skipped silently.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
import traceback
from contextlib import contextmanager
from typing import Any, Callable, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests"))

import torch  # noqa: E402

FAULT_VARS = ("SPECSERVE_STREAM_SANITIZER", "SPECSERVE_FAULT_ALIAS_ACCEPT_BUFFERS", "SPECSERVE_FAULT_COPY_LAG_MS",
              "SPECSERVE_FAULT_COPY_DELAY_MS", "SPECSERVE_FAULT_FORWARD_DELAY_MS", "SPECSERVE_HOST_WAITS")
# Every check the script runs, in its order (the speed checks, one per --speed-models entry, after
# them); benchmarks/render/cuda.py reads this tuple to say which ones a record never ran.
CHECKS = ("loops_and_graphs", "sanitizer_silent", "sanitizer_catches_alias", "no_host_waits", "alias_with_late_copies",
          "hicache_reload", "bf16_consistency", "cpu_agreement")
TEXTS = ["Count from 1 to 20, separated by commas.", "What is the capital of France?",
         "List the days of the week, then the months of the year.", "ab ab ab ab ab ab ab ab ab ab",
         "Write a haiku about rain.", "the cat the cat the cat sat", "Name three primary colours.", "x"]


def tiny_model(folder: str, size: str = "tiny") -> tuple[str, str]:
    """A random llama and a random DSpark drafter for it: "tiny" (4 layers of 256, fp32 weights),
    or "medium" (16 layers of 2048, 0.7B parameters in f16) where a decode step's device time is
    no longer negligible next to the host's."""
    from gguf import GGMLQuantizationType as QType
    from tiny_gguf import TinySpec, write_tiny_gguf

    from specserve.cli import main as cli_main

    path = os.path.join(folder, f"{size}-llama.gguf")
    if size == "tiny":
        write_tiny_gguf(path, TinySpec("llama", hidden=256, intermediate=512, layers=4, context=4096), {}, seed=1)
    else:
        spec = TinySpec("llama", hidden=2048, intermediate=5632, layers=16, heads=16, kv_heads=4, context=4096)
        names = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
        write_tiny_gguf(path, spec, {name: QType.F16 for name in names}, seed=1)
    drafter = os.path.join(folder, f"{size}-drafter")
    assert cli_main(["init-drafter", "--out", drafter, "--model-path", path, "--block-size", "4", "--seed", "3"]) == 0
    return path, drafter


def parse_each_gguf_once() -> None:
    """Engines of one model share one parse of its file (as the test suite's engines do): the
    medium model's dequantization is most of an engine build, and the speed check builds eight."""
    import specserve.models.loader as loader

    parsed: dict[str, Any] = {}
    original = loader._load_gguf

    def load_once(path: str):
        if path not in parsed:
            parsed[path] = original(path)
        return parsed[path]

    loader._load_gguf = load_once


def thread_stacks() -> str:
    names = {t.ident: t.name for t in threading.enumerate()}
    return "\n".join(f"--- thread {names.get(ident, ident)}\n" + "".join(traceback.format_stack(frame))
                     for ident, frame in sys._current_frames().items())


class Checks:
    """Runs named checks, keeping going after a failure: one run reports everything. A check that
    outlives `limit_s` is a hang: every thread's stack goes into the record, which is written, and
    the process exits 1 (a hang must not eat the device time of the checks after it)."""

    def __init__(self, limit_s: float, on_hang: Callable[[], None]) -> None:
        self.results: dict[str, Any] = {}
        self.failed: list[str] = []
        self.limit_s, self.on_hang = limit_s, on_hang

    def _hung(self, name: str) -> None:
        self.failed.append(name)
        self.results[name] = {"ok": False, "error": f"hung: still running after {self.limit_s:g} s",
                              "trace": thread_stacks()[-12000:]}
        print(f"[HANG] {name}: still running after {self.limit_s:g} s; stacks in the record", flush=True)
        self.on_hang()
        os._exit(1)

    def run(self, name: str, fn: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        watchdog = threading.Timer(self.limit_s, self._hung, args=(name,))
        watchdog.daemon = True
        watchdog.start()
        try:
            value = fn()
            self.results[name] = {"ok": True, "seconds": round(time.perf_counter() - start, 2), "value": value}
            print(f"[ok]   {name}: {json.dumps(value)[:300]}", flush=True)
            return value
        except Exception as exc:  # noqa: BLE001 (record every failure, run the rest)
            self.failed.append(name)
            self.results[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                                  "trace": traceback.format_exc()[-3000:]}
            print(f"[FAIL] {name}: {type(exc).__name__}: {exc}", flush=True)
            return None
        finally:
            watchdog.cancel()


@contextmanager
def env(**values: str):
    saved = {k: os.environ.get(k) for k in FAULT_VARS}
    for k in FAULT_VARS:
        os.environ.pop(k, None)
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


class Setup:
    """The model, drafter, prompts and the engine arguments of every configuration."""

    def __init__(self, model: str, drafter: str, device: str, prompts: Optional[list[list[int]]] = None) -> None:
        self.model, self.drafter, self.device = model, drafter, device
        from specserve import Engine

        if prompts is None:  # every model here has the tiny models' vocabulary
            with Engine(model_path=model, device="cpu", dtype="float32", speculative_algorithm="NONE") as probe:
                prompts = [probe.tokenizer.encode(t) for t in TEXTS]
        self.prompts = prompts

    def engine(self, algorithm: str = "NONE", overlap: bool = True, graphs: bool = True, dtype: str = "float32",
               device: str = "", **kw: Any):
        from specserve import Engine

        spec: dict[str, Any] = {"speculative_algorithm": algorithm.split("-")[0]}
        if algorithm == "DSPARK":
            spec.update(speculative_draft_model_path=self.drafter, speculative_policy="fixed")
        if algorithm in ("NGRAM", "SUFFIX"):
            spec.update(speculative_policy="fixed", speculative_num_steps=3)
        if algorithm == "DSPARK-policy":  # DSPARK and NGRAM under the adaptive policy, its decisions frozen
            from helpers import policy_args

            spec.update(speculative_draft_model_path=self.drafter, **policy_args())
        if algorithm == "DSPARK-compact":  # every window drafted, verified as long as the planner says
            spec.update(speculative_draft_model_path=self.drafter, speculative_policy="fixed",
                        speculative_verify_mode="compact", speculative_sps_table_path=self.sps_table())
        kw.setdefault("max_total_tokens", 8192)
        return Engine(model_path=self.model, device=device or self.device, dtype=dtype,
                      disable_overlap_schedule=not overlap, disable_cuda_graph=not graphs, **spec, **kw)


    def sps_table(self) -> str:
        """Steps/s against verified tokens on which short verify windows pay (compact verify plans)."""
        path = os.path.join(os.path.dirname(self.model), "sps.json")
        with open(path, "w") as f:
            json.dump({"tokens": [1, 10, 100], "steps_per_second": [100, 100, 5]}, f)
        return path


def generate(engine, prompts: list[list[int]], params: Any) -> list[dict[str, Any]]:
    """engine.generate, keeping the drafts accepted on the engine (`accepted_drafts`) for the record."""
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    engine.accepted_drafts = sum(o["meta_info"].get("spec_num_correct_drafts") or 0 for o in outs)
    return outs


def greedy(engine, prompts: list[list[int]], new_tokens: int = 32) -> list[list[int]]:
    params = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}
    return [o["output_ids"] for o in generate(engine, prompts, params)]


def mixed(engine, prompts: list[list[int]], new_tokens: int = 32) -> list[Any]:
    """Greedy requests beside a seeded sampled one, one with logprobs and one with penalties (the
    host-side sampling, logprob and logit-shaping paths on a device's logits): tokens and logprobs."""
    params: list[dict[str, Any]] = [{"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}
                                    for _ in prompts]
    params[1].update(temperature=0.8, top_p=0.9, seed=7)
    params[3].update(logprobs=True, top_logprobs=2)
    params[5].update(repetition_penalty=1.3, frequency_penalty=0.2)
    outs = generate(engine, prompts, params)
    logprobs = outs[3]["meta_info"].get("output_token_logprobs")
    return [o["output_ids"] for o in outs] + [logprobs]


def graphs_captured(engine) -> int:
    return engine.step_facts()["cuda_graphs"]


def greedy_rows(out: list[Any]) -> list[Any]:
    """The greedy requests' tokens of a `mixed` output (sampled tokens and logprobs left out): these
    must not depend on the algorithm."""
    return [out[i] for i in range(len(TEXTS)) if i != 1]


def loops_and_graphs(setup: Setup, reference: list[Any]) -> Callable[[], dict]:
    """Every (algorithm, loop, step kind) gives that algorithm's sync+eager output exactly (tokens,
    sampled tokens, logprobs), and every algorithm gives NONE's greedy tokens."""
    def check() -> dict:
        out: dict[str, Any] = {}
        for algorithm in ("NONE", "NGRAM", "DSPARK", "DSPARK-policy", "DSPARK-compact"):
            own = None
            for overlap, graphs in ((False, False), (True, True), (True, False), (False, True)):
                name = f"{algorithm} {'overlap' if overlap else 'sync'} {'graphs' if graphs else 'eager'}"
                with setup.engine(algorithm, overlap, graphs) as engine:
                    tokens = mixed(engine, setup.prompts)
                    own = tokens if own is None else own
                    out[name] = {"same_as_sync_eager": tokens == own, "greedy_as_none": greedy_rows(tokens) ==
                                 greedy_rows(reference), "graphs": graphs_captured(engine),
                                 "verify_steps": engine.scheduler.stats.verify_steps,
                                 "threaded_streams": engine.step_facts()["threaded_streams"],
                                 "accepted_drafts": engine.accepted_drafts}
                assert tokens == own, f"{name}: output differs from {algorithm} sync eager"
                assert greedy_rows(tokens) == greedy_rows(reference), f"{name}: greedy tokens differ from NONE"
                # Per-request windows (the adaptive policy) and compact verify run eagerly by design; the
                # policy's steps without drafts are captured decodes, but whether any occur is its timing.
                if graphs and setup.device.startswith("cuda") and algorithm in ("NONE", "NGRAM", "DSPARK"):
                    assert out[name]["graphs"] > 0, f"{name}: no CUDA graph was captured"
        return out
    return check


def sanitizer_silent(setup: Setup, reference: list[list[int]]) -> dict:
    with env(SPECSERVE_STREAM_SANITIZER="1"):
        with setup.engine("DSPARK") as engine:
            tokens = mixed(engine, setup.prompts)
            steps = engine.scheduler.stats.verify_steps
    assert greedy_rows(tokens) == greedy_rows(reference), "greedy tokens differ with the sanitizer on"
    return {"verify_steps": steps}


def sanitizer_catches_alias(setup: Setup) -> dict:
    """The stale-accept race's fault planted (read_accept hands out views): the sanitizer must fire on CUDA too."""
    from specserve.runtime.sanitizer import StreamHazardError
    from specserve.runtime.stream import StreamError

    with env(SPECSERVE_STREAM_SANITIZER="1", SPECSERVE_FAULT_ALIAS_ACCEPT_BUFFERS="1"):
        engine = setup.engine("DSPARK")
        try:
            greedy(engine, setup.prompts[:2])
        except (StreamHazardError, StreamError) as exc:
            assert "stream hazard" in str(exc), f"not a stream hazard: {exc!r}"
            return {"caught": str(exc)[:240], "verify_steps_before": engine.scheduler.stats.verify_steps}
        finally:
            engine.shutdown()
    raise AssertionError("the planted alias fault ran to the end without a stream hazard")


def cuda_choices(engine: Any) -> None:
    """CUDA's defaults, so that a CPU run checks the same paths: planned windows verified whole,
    SUFFIX walked on the device; and the opt-in lagged plans (the adaptive policy planning from the
    commits two launches back), whose waits this check covers too."""
    engine.set_step_choices(static_windows=True, lagged_plans=True, drafts_on_device=True)


def no_host_waits(setup: Setup) -> dict:
    """Launches that never wait on the device (SPECSERVE_HOST_WAITS=error: the host-wait detector and,
    on CUDA, torch's sync debug mode around every launch) for NONE, NGRAM, SUFFIX, DSPARK,
    DSPARK-compact and the adaptive policy (DSPARK-policy), greedy and seeded sampling, overlap loop
    with graphs, CUDA's choices (on CPU set as on CUDA); then a planted `.item()` in the step must be
    refused."""
    from specserve.executor.model_runner import ModelRunner

    params: list[dict[str, Any]] = [{"temperature": 0, "max_new_tokens": 24, "ignore_eos": True} for _ in TEXTS]
    for i in (1, 4, 6):
        params[i].update(temperature=0.8, top_p=0.9, seed=i)
    out: dict[str, Any] = {}
    with env(SPECSERVE_HOST_WAITS="error"):
        for algorithm in ("NONE", "NGRAM", "SUFFIX", "DSPARK", "DSPARK-compact", "DSPARK-policy"):
            with setup.engine(algorithm) as engine:
                cuda_choices(engine)
                generate(engine, setup.prompts, params)
                out[algorithm] = {"overlapped_steps": engine.loop.overlapped_steps,
                                  "verify_steps": engine.scheduler.stats.verify_steps}
        original = ModelRunner._pick

        def planted(self, handle, indices, logits, *args):
            logits[0, 0].item()  # the planted wait
            return original(self, handle, indices, logits, *args)

        ModelRunner._pick = planted
        try:
            with setup.engine("NONE") as engine:
                greedy(engine, setup.prompts[:1], new_tokens=4)
        except Exception as exc:  # the detector's HostWaitError, or CUDA's sync debug mode error, via the stream
            out["planted_item"] = str(exc)[:240]
        finally:
            ModelRunner._pick = original
    assert "planted_item" in out, "a planted .item() in the step ran without a host-wait error"
    return out


def alias_with_late_copies(setup: Setup, reference: list[list[int]]) -> dict:
    """The stale-accept race's symptom on real CUDA streams (recorded, not asserted: whether a late copy reads the
    next step's values depends on the GPU's timing), and the same lag without the fault (asserted
    harmless)."""
    out = {}
    for alias in ("1", "0"):
        with env(SPECSERVE_FAULT_COPY_LAG_MS="20", SPECSERVE_FAULT_ALIAS_ACCEPT_BUFFERS=alias):
            with setup.engine("NGRAM") as engine:
                tokens = mixed(engine, setup.prompts)
                lag = engine.step_facts()["copy_lag"]
                diff = sum(a != b for a, b in zip(greedy_rows(tokens), greedy_rows(reference)))
                out[f"alias={alias}"] = {"greedy_requests_differing": diff,
                                         "overlapped_steps": engine.loop.overlapped_steps,
                                         "lag_timeouts": None if lag is None else lag["timeouts"]}
        if alias == "0":
            assert diff == 0, "the copy lag alone changed tokens"
    return out


def hicache_reload(setup: Setup) -> dict:
    """An evicted prefix comes back from (pinned) host memory with the same tokens."""
    out = {}
    long_prompt = setup.prompts[2] * 6
    fillers = [setup.prompts[i] * 5 + [i] for i in range(len(setup.prompts))]
    for algorithm in ("NONE", "DSPARK"):
        with setup.engine(algorithm, max_total_tokens=480, enable_hierarchical_cache=True, hicache_ratio=4.0,
                          max_running_requests=4) as engine:
            first = greedy(engine, [long_prompt], 16)
            for filler in fillers:
                greedy(engine, [filler], 16)
            again = engine.generate(input_ids=long_prompt, sampling_params={"temperature": 0, "max_new_tokens": 16,
                                                                          "ignore_eos": True})
            stats = engine.scheduler.ledger.tree.stats
            pinned = engine.scheduler.ledger.tree.host.k[0][0].is_pinned()
            engine.scheduler.ledger.tree.check_host_integrity()
            engine.scheduler.check_integrity()
            out[algorithm] = {"evicted_to_host": stats.device_evicted_to_host, "host_hit_tokens": stats.host_hit_tokens,
                              "cached_tokens": again["meta_info"]["cached_tokens"], "host_pinned": pinned}
            assert stats.device_evicted_to_host > 0 and stats.host_hit_tokens > 0, f"{algorithm}: no host reload"
            assert again["output_ids"] == first[0], f"{algorithm}: reloaded prefix gave other tokens"
    return out


def bf16_consistency(setup: Setup) -> dict:
    """bf16 on CUDA runs torch's (cuBLAS) matmuls, which are not batch-invariant: recorded only."""
    tokens = {}
    for overlap, graphs in ((True, True), (False, False)):
        with setup.engine("NONE", overlap, graphs, dtype="bfloat16") as engine:
            tokens[(overlap, graphs)] = greedy(engine, setup.prompts)
        with setup.engine("NONE", overlap, graphs, dtype="bfloat16") as engine:
            alone = [greedy(engine, [p])[0] for p in setup.prompts]
        tokens[("alone", overlap, graphs)] = alone
    a, b = tokens[(True, True)], tokens[(False, False)]
    return {"overlap_graphs_vs_sync_eager_identical_requests": sum(x == y for x, y in zip(a, b)),
            "batched_vs_alone_identical_requests": sum(x == y for x, y in zip(a, tokens[("alone", True, True)])),
            "requests": len(a)}


def cpu_agreement(setup: Setup, reference: list[list[int]]) -> dict:
    """fp32 CUDA against fp32 CPU: different matmul kernels, so agreement is recorded, not required."""
    with setup.engine("NONE", False, False, device="cpu") as engine:
        cpu = greedy_rows(mixed(engine, setup.prompts))
    cuda = greedy_rows(reference)
    same = sum(a == b for a, b in zip(cpu, cuda))
    prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(cpu, cuda)]
    return {"identical_requests": same, "requests": len(cpu), "first_difference": prefix}


def speed(setup: Setup, runs: int) -> dict:
    """Decode tokens/s (fp32, NONE and DSPARK, 128 new tokens) per loop and step kind, median of
    `runs` interleaved generations with the range, and the ratios against sync + eager."""
    print(f"speed on {os.path.basename(setup.model)}", flush=True)
    out: dict[str, Any] = {}
    configs = {"overlap+graphs": (True, True), "sync+graphs": (False, True), "overlap+eager": (True, False),
               "sync+eager": (False, False)}
    for algorithm in ("NONE", "DSPARK"):
        engines = {name: setup.engine(algorithm, o, g, disable_radix_cache=True) for name, (o, g) in configs.items()}
        for batch in (1, 16):
            prompts = [setup.prompts[i % len(setup.prompts)] + [i] for i in range(batch)]
            samples: dict[str, list[float]] = {name: [] for name in configs}
            for eng in engines.values():
                greedy(eng, prompts, 16)  # warm: graphs captured, allocator settled
            for _ in range(runs):
                for name, eng in engines.items():
                    start = time.perf_counter()
                    tokens = greedy(eng, prompts, 128)
                    samples[name].append(sum(map(len, tokens)) / (time.perf_counter() - start))
            base = statistics.median(samples["sync+eager"])
            out[f"{algorithm} batch {batch}"] = {
                name: {"tok_s": round(statistics.median(s), 1), "range": [round(min(s), 1), round(max(s), 1)],
                       "vs_sync_eager": round(statistics.median(s) / base, 2)} for name, s in samples.items()}
        for eng in engines.values():
            eng.shutdown()
    return out


def write(path: str, record: dict[str, Any], checks: Checks) -> None:
    record.update(checks=checks.results, failed=checks.failed)
    with open(path, "w") as f:
        json.dump(record, f, indent=1)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--commit", default=None, help="the commit checked (the device's copy has no .git)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--speed-models", default="tiny,medium", help="models the speed check runs on")
    p.add_argument("--skip", default="", help="comma-separated checks to leave out (named in the record)")
    p.add_argument("--check-limit", type=float, default=150.0, help="seconds after which a check counts as hung")
    ns = p.parse_args()
    import specserve.runtime.stream as stream

    stream.EVENT_TIMEOUT_S = min(stream.EVENT_TIMEOUT_S, ns.check_limit / 2)  # a stuck stream raises inside the limit
    skip = set(filter(None, ns.skip.split(",")))
    from specserve.bench.provenance import commit

    record: dict[str, Any] = {
        "commit": ns.commit or commit(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "device": torch.cuda.get_device_name() if ns.device.startswith("cuda") else platform.processor(),
        "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(), "runs": ns.runs,
        "skipped": sorted(skip)}
    checks = Checks(ns.check_limit, lambda: write(ns.out, record, checks))
    parse_each_gguf_once()
    with tempfile.TemporaryDirectory() as folder:
        setup = Setup(*tiny_model(folder), ns.device)
        with setup.engine("NONE", overlap=False, graphs=False) as engine:
            reference = mixed(engine, setup.prompts)
        record["reference_tokens"] = reference
        check_fns: dict[str, Callable[[], Any]] = {
            "loops_and_graphs": loops_and_graphs(setup, reference),
            "sanitizer_silent": lambda: sanitizer_silent(setup, reference),
            "sanitizer_catches_alias": lambda: sanitizer_catches_alias(setup),
            "no_host_waits": lambda: no_host_waits(setup),
            "alias_with_late_copies": lambda: alias_with_late_copies(setup, reference),
            "hicache_reload": lambda: hicache_reload(setup),
            "bf16_consistency": lambda: bf16_consistency(setup),
            "cpu_agreement": lambda: cpu_agreement(setup, reference),
        }
        assert tuple(check_fns) == CHECKS, "CHECKS names every check, in order"
        plan: list[tuple[str, Callable[[], Any]]] = list(check_fns.items())
        for size in filter(None, ns.speed_models.split(",")):
            plan.append((f"speed_{size}", lambda size=size: speed(
                setup if size == "tiny" else Setup(*tiny_model(folder, size), ns.device, setup.prompts), ns.runs)))
        for name, fn in plan:
            if name not in skip:
                checks.run(name, fn)
                write(ns.out, record, checks)  # after each check: a run cut short keeps what it did
    print(f"{len(checks.results) - len(checks.failed)} of {len(checks.results)} checks passed; record: {ns.out}")
    return 1 if checks.failed else 0


if __name__ == "__main__":
    sys.exit(main())
