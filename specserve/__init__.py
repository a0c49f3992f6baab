"""specserve: a compact, real LLM serving engine built around DSpark block speculative decoding."""

from specserve.sampling_params import SamplingParams


def __getattr__(name: str):
    # Engine pulls in torch and the model code; import it lazily so `specserve --help` stays fast.
    if name == "Engine":
        from specserve.engine.engine import Engine

        return Engine
    raise AttributeError(name)


__all__ = ["Engine", "SamplingParams"]
