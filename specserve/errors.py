"""Typed errors that cross package and process boundaries.

`InvalidRequestError` is what any layer raises for bad input from a client: it names the field
(`param`) and, where the OpenAI API has one, a machine-readable `code`. It is a ValueError, so
the offline API and the command line treat it as one; the server maps it to an HTTP 400 without
looking inside the message.
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
