"""The engine's three kinds of error, typed so that each boundary can tell them apart.

- `InvalidRequestError`: bad input from a client. It names the field (`param`) and, where the
  OpenAI API has one, a machine-readable `code`; the server answers it with an HTTP 400.
- `ConfigError`: a bad setting: a flag, an environment switch, or a model, drafter or table file
  that does not fit. The command line prints it as one line and exits 2; the server does not start.
- `InternalError`: a broken invariant of the engine itself. It is never the client's fault (never
  a 4xx): a request that hits one fails with a 500, and the engine fails loudly.

The first two are ValueErrors, so the offline API treats them as Python code expects.
"""

from __future__ import annotations

from typing import Optional


class InvalidRequestError(ValueError):
    """Bad client input: `param` names the offending field, `code` is an OpenAI error code or None."""

    def __init__(self, message: str, param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.param = param
        self.code = code

    def __reduce__(self):  # keep param and code across pickling (engine process -> HTTP process)
        return (type(self), (str(self), self.param, self.code))


class ConfigError(ValueError):
    """A setting that cannot work: the message names the flag, switch or file."""


class InternalError(RuntimeError):
    """A broken invariant of the engine (a bug, never bad input)."""
