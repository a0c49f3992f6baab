"""Live servers for the HTTP tests: one for the API, one (tiny context, tiny queue) for limits."""

from __future__ import annotations

import pytest

from helpers import API_KEY, ServerProcess


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """The default engine: DSPARK with the shipped drafter, in bf16, whose greedy output is batch-,
    cache- and stream-invariant (specserve's CPU kernels)."""
    srv = ServerProcess("--api-key", API_KEY, "--max-total-tokens", "40000",
                        log_path=str(tmp_path_factory.mktemp("server") / "server.log"))
    yield srv
    code = srv.stop()
    assert code == 0, f"server exited with {code} on SIGTERM:\n{srv.log()}"


@pytest.fixture(scope="session")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="session")
def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}
