"""The engine: builds the components of one rank and runs them (offline API and serving steps)."""

from specserve.engine.engine import Engine

__all__ = ["Engine"]
