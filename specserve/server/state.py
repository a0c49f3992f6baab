"""ServerState: what the routes, the middleware and the generations of one app share."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

from specserve.server.engine_client import EngineClient
from specserve.server.metrics import ServerMetrics
from specserve.tokenizer.tokenizer import Tokenizer


@dataclass
class ServerState:
    """One per app: the engine handle, the tokenizer, the metrics and the serving limits."""

    client: EngineClient
    tokenizer: Tokenizer
    metrics: ServerMetrics
    model_name: str
    model_path: str = ""  # the weights file or directory served
    settings: dict[str, Any] = field(default_factory=dict)  # the server's and engine's flags (/server_info)
    api_key: Optional[str] = None
    max_queued_requests: int = 256  # requests waiting for their first token; beyond this a request gets 503
    max_request_bytes: int = 8 << 20  # larger bodies get 413
    started_at: int = field(default_factory=lambda: int(time.time()))  # /v1/models "created"
    reasoning_parser: Optional[str] = None  # --reasoning-parser: how a reply's reasoning is told from its answer
    tool_call_parser: str = "qwen25"  # --tool-call-parser: the format of the calls a model writes

    @property
    def context_length(self) -> int:
        return self.client.info["context_length"]
