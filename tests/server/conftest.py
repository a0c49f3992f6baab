"""Live servers for the HTTP tests: one for the API, one (tiny context, tiny queue) for limits."""

from __future__ import annotations

import pytest

from helpers import API_KEY, ServerProcess, cheap_drafting_table


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """The default engine: the adaptive policy over the shipped DSpark drafter and NGRAM, in bf16,
    whose greedy output is batch-, cache- and stream-invariant (specserve's CPU kernels). Its cost
    table is the tests' frozen one on which drafting pays, so every request speculates."""
    srv = ServerProcess("--api-key", API_KEY, "--max-total-tokens", "40000",
                        "--speculative-cost-table-path", cheap_drafting_table(), "--speculative-freeze-cost-table",
                        log_path=str(tmp_path_factory.mktemp("server") / "server.log"))
    yield srv
    code = srv.stop()
    assert code == 0, f"server exited with {code} on SIGTERM:\n{srv.log()}"


@pytest.fixture(scope="session")
def client(server):
    import openai
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="session")
def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}
