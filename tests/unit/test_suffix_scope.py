"""`--speculative-suffix-scope`: under `request` a SUFFIX draft comes from the request's own tokens
only, so its speed never reveals another request's output (docs/server.md, Security).

The case: an earlier request's output holds the continuation of a later greedy request's suffix,
which its own tokens do not. Under `global` the later request drafts that continuation (the
control: the case does reach the global index); under `request` it drafts nothing, on the host
walk and the device walk alike, and the global index never holds a token.
"""

from __future__ import annotations

import argparse

import pytest
import torch

from specserve.args import ServerArgs
from specserve.errors import ConfigError
from specserve.sampling_params import SamplingParams
from specserve.speculative.speculation import Speculation
from specserve.speculative.suffix_worker import SuffixConfig, SuffixWorker
from specserve.speculative.committed import TokenTable
from specserve.speculative.worker import DraftInput

GREEDY = SamplingParams(temperature=0)
EARLIER = [1, 2, 3, 4, 5, 6, 7, 8]  # prompt [1, 2], output [3..8]
LATER = [20, 21, 4, 5]  # its suffix [4, 5] occurred only in EARLIER's output, then 6, 7
FROM_THE_EARLIER_OUTPUT = [6, 7, 7, 7]  # spec factor 1: as many drafts as matched, then filler
FROM_ITS_OWN_TOKENS = [5, 5, 5, 5]  # nothing matched: the anchor repeated


def fed(spec: Speculation, table: TokenTable, row: int, tokens: list[int], prompt: int, launch: int) -> None:
    """Slot `row` holds a request with these tokens (the first `prompt` its prompt), on both sides."""
    spec.commit_tokens(row, tokens[: prompt + 1], restart=True, new=1, launch=launch)
    if len(tokens) > prompt + 1:
        spec.commit_tokens(row, tokens[prompt + 1 :], restart=False, launch=launch)
    table.write_sequence(row, tokens)


def draft_input(spec: Speculation, row: int, length: int, table: TokenTable, gamma: int, launch: int) -> DraftInput:
    """One greedy request in slot `row` drafting after its first `length` tokens."""
    anchors = torch.tensor([int(table.tokens[row, length - 1])])
    zero = torch.zeros(1, dtype=torch.int64)
    return DraftInput(torch.tensor([row]), anchors, torch.tensor([length - 1]), zero, [GREEDY], [0], gamma, None,
                      length + 1, launch, [spec.requests[row]])


def after_an_earlier_request(scope: str, on_device: bool) -> tuple[SuffixWorker, TokenTable, Speculation]:
    """EARLIER finished in slot 0 (its output retired when the slot's next request started), LATER
    running in slot 1 (the Speculation keeps each slot's RequestTokens, which the worker reads)."""
    table = TokenTable(4, 64)
    worker = SuffixWorker(4, SuffixConfig(scope=scope), table, drafts_on_device=on_device)
    spec = Speculation([worker])
    fed(spec, table, 0, EARLIER, 2, launch=1)
    fed(spec, table, 0, [9, 9], 1, launch=2)
    fed(spec, table, 1, LATER, 3, launch=2)
    return worker, table, spec


@pytest.mark.parametrize("on_device", [False, True], ids=["host-walk", "device-walk"])
@pytest.mark.parametrize("scope,expected", [("global", FROM_THE_EARLIER_OUTPUT), ("request", FROM_ITS_OWN_TOKENS)])
def test_a_request_scoped_draft_never_comes_from_an_earlier_output(scope, expected, on_device):
    worker, table, spec = after_an_earlier_request(scope, on_device)
    drafts = worker.draft(draft_input(spec, 1, len(LATER), table, 4, launch=4)).tokens  # launch 2's changes are due
    assert drafts.tolist() == [expected]


@pytest.mark.parametrize("on_device", [False, True], ids=["host-walk", "device-walk"])
def test_a_request_scoped_walk_never_reads_the_global_index(on_device):
    """Not only left empty: were an output planted in the global index (host and device), a
    request-scoped walk would still not read it (nor spend the global walk's time)."""
    worker, table, spec = after_an_earlier_request("request", on_device)
    worker.global_index.append_segment(EARLIER[2:])
    assert worker.segments is not None
    worker.segments.change(2, "append", EARLIER[2:])
    drafts = worker.draft(draft_input(spec, 1, len(LATER), table, 4, launch=4)).tokens
    assert drafts.tolist() == [FROM_ITS_OWN_TOKENS] and worker.hints([spec.requests[1]]) == [(0, 0)]


@pytest.mark.parametrize("scope,hint", [("global", (1, 2)), ("request", (0, 0))])
def test_the_policy_hints_follow_the_scope(scope, hint):
    """The adaptive policy drafts by the hints, so they must not see the earlier output either."""
    worker, _, spec = after_an_earlier_request(scope, on_device=False)
    assert worker.hints([spec.requests[1]]) == [hint]


@pytest.mark.parametrize("on_device", [False, True], ids=["host-walk", "device-walk"])
def test_the_global_index_holds_nothing_under_request_scope(on_device):
    shared, _, _ = after_an_earlier_request("global", on_device)
    private, _, _ = after_an_earlier_request("request", on_device)
    assert shared.global_index.tokens[:-1] == EARLIER[2:]  # the control: its output, after its prompt
    assert len(private.global_index) == 0 and private.global_index.tokens == [] and not private.global_index.index
    assert private.segments is not None and private.segments.held(None).numel() == 0


def test_the_scope_flows_from_the_flag_to_the_config():
    assert SuffixConfig.of(ServerArgs()).shares_outputs  # the default: one operator's server, unchanged
    config = SuffixConfig.of(ServerArgs(speculative_suffix_scope="request"))
    assert config.scope == "request" and not config.shares_outputs
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = ServerArgs.from_cli_args(parser.parse_args(["--speculative-suffix-scope", "request"]))
    assert not SuffixConfig.of(args).shares_outputs


def test_a_bad_scope_is_refused_with_the_choices(capsys):
    message = r"speculative_suffix_scope must be one of \('global', 'request'\), got 'tenant'"
    with pytest.raises(ConfigError, match=message):
        ServerArgs(speculative_suffix_scope="tenant")
    with pytest.raises(ConfigError, match=message):
        SuffixConfig(scope="tenant")  # built directly: a typo must not fall back to sharing
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative-suffix-scope", "tenant"])
    assert "invalid choice: 'tenant' (choose from 'global', 'request')" in capsys.readouterr().err
