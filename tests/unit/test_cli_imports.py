"""`specserve serve` reads its flags without importing torch: the server spawns its engine
process first and only then does its own heavier work, so an import in the parent before the
spawn is paid in full on every start (about a second for torch on these machines). Each check
runs in a fresh interpreter, since this one has torch loaded already."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from specserve import cli

PARSE = """
import sys
from specserve import cli
argv = {argv!r}
only = cli.named_command(argv) if {selective} else None
ns = cli.build_parser(only=only).parse_args(argv)
print(ns.command, "torch" in sys.modules)
"""


def _parse_in_fresh_python(argv: list[str], selective: bool) -> str:
    """The parse in a fresh interpreter with a user's plain environment: no SPECSERVE_* settings
    (another test's fault-injection variable, for one, has the parse read fault settings with torch)."""
    code = PARSE.format(argv=argv, selective=selective)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECSERVE_")}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout.split()


def test_parsing_serve_flags_imports_no_torch():
    argv = ["serve", "--model-path", "m.gguf", "--port", "8000"]
    assert _parse_in_fresh_python(argv, selective=True) == ["serve", "False"]


def test_building_every_command_does_import_torch():
    """The check above can fail: the full parser (every command's flags) imports torch."""
    assert _parse_in_fresh_python(["serve", "--model-path", "m.gguf"], selective=False) == ["serve", "True"]


@pytest.mark.parametrize(
    "argv, name",
    [(["serve", "--port", "1"], "serve"), (["bench", "offline", "--batch-size", "2"], "bench offline"),
     (["--help"], None), (["bench"], None), (["nonsense", "serve"], None)],
)  # fmt: skip
def test_the_named_command_is_read_from_the_first_words(argv, name):
    assert cli.named_command(argv) == name


def test_a_selective_parser_still_lists_every_command(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    listing = capsys.readouterr().out
    assert all(c.name.split()[0] in listing for c in cli.COMMANDS)


CHECK = """
import sys
from specserve import cli
from specserve.args import ServerArgs
argv = {argv!r}
args = ServerArgs.from_cli_args(cli.build_parser(only=cli.named_command(argv)).parse_args(argv))
print(args.speculative_algorithm, "torch" in sys.modules)
"""


def test_checking_the_flags_reads_the_drafters_declarations_without_torch():
    """The flag checks run in the server's parent before it spawns the engine: the drafters'
    declarations (specserve/drafters/) they read import no torch; the workers load with the engine."""
    argv = ["serve", "--model-path", "m.gguf", "--speculative-algorithm", "SUFFIX", "--speculative-suffix-max-tree-depth", "8"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECSERVE_")}
    out = subprocess.run([sys.executable, "-c", CHECK.format(argv=argv)], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.split() == ["SUFFIX", "False"]
