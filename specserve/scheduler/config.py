"""SchedulerConfig: the scheduling knobs, in a module of their own so that the scheduler's parts
(admission.py, ...) read them without importing the Scheduler that composes them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduling knobs (a subset of ServerArgs plus model facts)."""

    context_length: int
    eos_token_ids: tuple[int, ...] = ()
    max_running_requests: int = 64
    max_prefill_tokens: int = 8192
    chunked_prefill_size: int = 2048
    schedule_policy: str = "fcfs"
    num_draft_tokens: int = 0  # gamma: the window of a decode step is 1 + gamma positions (0: plain decode)
