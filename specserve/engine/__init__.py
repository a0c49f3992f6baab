"""The engine: builds the components of one rank and runs them (offline API and serving steps).

`Engine` is imported lazily: the HTTP process imports `engine.messages` without the model code.
"""


def __getattr__(name: str):
    if name == "Engine":
        from specserve.engine.engine import Engine

        return Engine
    raise AttributeError(name)


__all__ = ["Engine"]
