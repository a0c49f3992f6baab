"""The command line's two kinds of failure: a bad flag, setting or file is one line and exit 2,
wherever it is found (before or after the model loads); any other error during a run is a
failure with its traceback, never exit 2. The runs are planted: no model loads."""

from __future__ import annotations

import pytest

from specserve import cli
from specserve.errors import ConfigError, InvalidRequestError

ARGV = ["init-drafter", "--out", "unused"]


def _plant(monkeypatch, error: Exception) -> None:
    def run(ns):
        raise error
    real = cli._resolve
    monkeypatch.setattr(cli, "_resolve", lambda ref: run if ref == "specserve.cli:_init_drafter" else real(ref))


@pytest.mark.parametrize("error", [ConfigError("--block-size: planted"), InvalidRequestError("sampling_params.top_k: planted")])
def test_a_bad_setting_found_during_the_run_is_one_line_and_exit_2(monkeypatch, capsys, error):
    _plant(monkeypatch, error)
    assert cli.main(ARGV) == 2
    err = capsys.readouterr().err
    assert err == f"specserve init-drafter: error: {error}\n"


@pytest.mark.parametrize("error", [ValueError("planted bug"), RuntimeError("planted bug"), KeyError("planted bug")])
def test_any_other_failure_during_the_run_propagates_with_its_traceback(monkeypatch, error):
    """Python then prints the traceback and exits 1: a multi-hour run that fails says where."""
    _plant(monkeypatch, error)
    with pytest.raises(type(error), match="planted bug"):
        cli.main(ARGV)


def test_a_bad_flag_is_refused_before_the_run(monkeypatch, capsys):
    _plant(monkeypatch, RuntimeError("the run must not start"))
    assert cli.main(["init-drafter", "--out", "unused", "--block-size", "0"]) == 2
    assert "block-size" in capsys.readouterr().err


def test_a_malformed_number_list_flag_is_one_line_and_exit_2(capsys):
    assert cli.main(["bench", "spec", "--batch-sizes", "1,x"]) == 2
    assert capsys.readouterr().err == "specserve bench spec: error: --batch-sizes: expected comma-separated int values, " \
        "got '1,x'\n"
