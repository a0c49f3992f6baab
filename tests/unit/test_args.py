"""ServerArgs: speculative flags and the verify-mode environment variable."""

import dataclasses
import logging

import pytest

from specserve.args import ServerArgs
from specserve.errors import ConfigError


def test_verify_mode_comes_from_flag_then_environment_then_static(monkeypatch):
    monkeypatch.delenv("SPECSERVE_VERIFY_MODE", raising=False)
    monkeypatch.delenv("SPECSERVE_RAGGED_VERIFY_MODE", raising=False)
    assert ServerArgs().verify_mode() == "static"
    monkeypatch.setenv("SPECSERVE_VERIFY_MODE", "compact")
    assert ServerArgs().verify_mode() == "compact"
    assert ServerArgs(speculative_verify_mode="static").verify_mode() == "static"
    monkeypatch.setenv("SPECSERVE_VERIFY_MODE", "ragged")
    with pytest.raises(ValueError, match="SPECSERVE_VERIFY_MODE"):
        ServerArgs().verify_mode()


def test_the_old_verify_mode_names_still_work_and_log_their_deprecation(monkeypatch, caplog):
    monkeypatch.delenv("SPECSERVE_VERIFY_MODE", raising=False)
    monkeypatch.setenv("SPECSERVE_RAGGED_VERIFY_MODE", "compact")
    with caplog.at_level(logging.WARNING, logger="specserve.args"):
        assert ServerArgs().verify_mode() == "compact"
    assert "SPECSERVE_RAGGED_VERIFY_MODE is deprecated: use SPECSERVE_VERIFY_MODE" in caplog.text
    monkeypatch.setenv("SPECSERVE_VERIFY_MODE", "static")  # the new name wins
    assert ServerArgs().verify_mode() == "static"
    monkeypatch.setenv("SPECSERVE_RAGGED_VERIFY_MODE", "ragged")
    monkeypatch.delenv("SPECSERVE_VERIFY_MODE")
    with pytest.raises(ValueError, match="SPECSERVE_RAGGED_VERIFY_MODE"):
        ServerArgs().verify_mode()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="specserve.args"):
        args = ServerArgs(speculative_dspark_verify_mode="static", speculative_dspark_sps_table_path="/t.json")
    assert (args.speculative_verify_mode, args.speculative_sps_table_path) == ("static", "/t.json")
    assert args.speculative_dspark_verify_mode is None and args.speculative_dspark_sps_table_path is None
    assert dataclasses.replace(args).speculative_verify_mode == "static"  # a resolved copy checks again
    assert "--speculative-dspark-verify-mode is deprecated: use --speculative-verify-mode" in caplog.text
    assert "--speculative-dspark-sps-table-path is deprecated: use --speculative-sps-table-path" in caplog.text
    with pytest.raises(ConfigError, match="speculative_verify_mode='compact' and its old name"):
        ServerArgs(speculative_verify_mode="compact", speculative_dspark_verify_mode="static")
    assert ServerArgs(speculative_verify_mode="static", speculative_dspark_verify_mode="static").verify_mode() == "static"


@pytest.mark.parametrize("kwargs, field", [
    ({"speculative_algorithm": "EAGLE"}, "speculative_algorithm"),
    ({"speculative_dspark_block_size": 0}, "speculative_dspark_block_size"),
    ({"speculative_dspark_block_size": 16}, "speculative_dspark_block_size"),
    ({"speculative_algorithm": "DSPARK", "model_path": "other.gguf"}, "speculative_draft_model_path"),
    ({"speculative_verify_mode": "ragged"}, "speculative_verify_mode"),
    ({"speculative_algorithm": "STANDALONE", "model_path": "other.gguf"}, "speculative_draft_model_path"),
    ({"model_path": "other.gguf", "speculative_policy_drafters": "STANDALONE,NGRAM"}, "speculative_policy_drafters"),
    ({"speculative_dspark_verify_mode": "ragged"}, "speculative_verify_mode"),  # the old name, read as the new
])
def test_bad_speculative_settings_name_their_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ServerArgs(**kwargs)


def test_embedded_model_speculates_with_its_shipped_drafter_and_any_other_with_ngram():
    from specserve.assets import default_drafter_path

    shipped = default_drafter_path()
    assert shipped is not None, "the embedded model's drafter must ship with the package"
    args = ServerArgs()
    assert args.speculative_algorithm == "DSPARK" and args.speculative_draft_model_path == shipped
    assert ServerArgs(speculative_algorithm="DSPARK").speculative_draft_model_path == shipped
    assert not ServerArgs(speculative_algorithm="NONE").speculating
    assert ServerArgs(speculative_algorithm="NGRAM").speculative_draft_model_path is None
    assert ServerArgs(speculative_draft_model_path="/x").speculative_draft_model_path == "/x"
    other = ServerArgs(model_path="other.gguf")  # another target: no drafter is assumed, NGRAM is
    assert other.speculative_algorithm == "NGRAM" and other.speculative_policy == "adaptive"
    assert other.policy_drafters() == ("NGRAM", "SUFFIX") and other.speculative_draft_model_path is None
    assert not ServerArgs(model_path="other.gguf", speculative_algorithm="NONE").speculating
    drafted = ServerArgs(model_path="other.gguf", speculative_algorithm="DSPARK", speculative_draft_model_path="/x")
    assert drafted.speculative_algorithm == "DSPARK" and drafted.speculative_draft_model_path == "/x"
    standalone = ServerArgs(model_path="other.gguf", speculative_algorithm="STANDALONE", speculative_draft_model_path="/x")
    assert standalone.policy_drafters() == ("STANDALONE", "NGRAM", "SUFFIX")


# ---------------------------------------------------------------- ranges and types of every field

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("kwargs, field", [
    ({"num_threads": -1}, "num_threads"), ({"num_threads": 0}, "num_threads"),
    ({"random_seed": -1}, "random_seed"), ({"random_seed": 2**64}, "random_seed"),
    ({"log_level": "loud"}, "log_level"),
    ({"hicache_storage_max_bytes": 0}, "hicache_storage_max_bytes"),
    ({"hicache_storage_max_bytes": -5}, "hicache_storage_max_bytes"),
    ({"max_running_requests": 0}, "max_running_requests"), ({"max_total_tokens": 8}, "max_total_tokens"),
    ({"mem_fraction_static": NAN}, "mem_fraction_static"), ({"collective_timeout": NAN}, "collective_timeout"),
    ({"collective_timeout": INF}, "collective_timeout"), ({"collective_timeout": 0}, "collective_timeout"),
    ({"enable_hierarchical_cache": True, "hicache_ratio": NAN}, "hicache_ratio"),
    ({"max_running_requests": "8"}, "max_running_requests"), ({"tp_size": True}, "tp_size"),
    ({"disable_radix_cache": 1}, "disable_radix_cache"), ({"dtype": None}, "dtype"),
    ({"dist_init_addr": "127.0.0.1:70000"}, "dist_init_addr"), ({"dist_init_addr": "127.0.0.1:0"}, "dist_init_addr"),
    ({"dist_init_addr": ":1234"}, "dist_init_addr"),
    ({"hicache_storage_backend": "file", "hicache_storage_dir": "/tmp/x"}, "hicache_storage_backend"),
])
def test_out_of_range_or_mistyped_fields_name_themselves(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        ServerArgs(**kwargs)


def test_storage_cap_defaults_to_4_gib_and_accepts_any_positive_size():
    assert ServerArgs().hicache_storage_max_bytes == 4 << 30
    assert ServerArgs(hicache_storage_max_bytes=1).hicache_storage_max_bytes == 1


def _file_tier(directory) -> dict:
    return {"enable_hierarchical_cache": True, "hicache_storage_backend": "file", "hicache_storage_dir": str(directory)}


def test_an_unusable_storage_dir_is_rejected_up_front(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="^hicache_storage_dir: .* is not a directory"):
        ServerArgs(**_file_tier(tmp_path / "file" / "cache"))
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setattr("specserve.args.os.geteuid", lambda: shared.stat().st_uid + 1)
    with pytest.raises(ValueError, match="^hicache_storage_dir: .*another user"):
        ServerArgs(**_file_tier(shared))


def test_an_unwritable_storage_dir_is_rejected_up_front(tmp_path, monkeypatch):
    import tempfile

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "TemporaryFile", refuse)  # root may write anywhere: simulate the refusal
    with pytest.raises(ValueError, match="^hicache_storage_dir: .* is not writable"):
        ServerArgs(**_file_tier(tmp_path))
    with pytest.raises(ValueError, match="^hicache_storage_dir: .* cannot be created in"):
        ServerArgs(**_file_tier(tmp_path / "new"))


def test_a_storage_dir_to_be_created_passes_without_being_created(tmp_path):
    ServerArgs(**_file_tier(tmp_path / "a" / "b"))
    assert not (tmp_path / "a").exists()  # validating flags has no side effects


# ---------------------------------------------------------------- the command line (in process, no model)


@pytest.mark.parametrize("argv, words", [
    (["serve", "--port", "70000"], "--port must be in ["),
    (["serve", "--max-request-bytes", "-1"], "--max-request-bytes must be >= 1"),
    (["serve", "--num-threads", "-2"], "num_threads must be >= 1"),
    (["soak", "--wave", "0"], "--wave must be >= 1"),
    (["bench", "serving", "--timeout", "0"], "--timeout must be > 0"),
    (["generate", "--hicache-storage-max-bytes", "0"], "hicache_storage_max_bytes must be >= 1"),
    (["generate", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["generate", "--num-threads", "x"], "invalid int value"),
])
def test_bad_flags_exit_2_with_one_argparse_style_line(argv, words, capsys):
    from specserve.cli import main

    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own errors (a value that is not a number) exit
        code = exc.code
    err = capsys.readouterr().err
    prog = "specserve " + " ".join(a for a in argv[:2] if not a.startswith("-"))
    assert code == 2 and err.count("\n") == 1 and err.startswith(f"{prog}: error: ") and words in err, err


def test_a_fixed_policy_soak_without_verify_steps_is_a_problem():
    """The soak drafts every step by default; one that ran no verify step exercised nothing of the
    accept path and must fail, not pass."""
    from specserve.bench.soak import SOAK_DEFAULTS, speculation_problems

    fixed = ServerArgs(**SOAK_DEFAULTS)
    assert fixed.speculative_policy == "fixed"
    assert speculation_problems(fixed, verify_steps=0) == [
        "DSPARK with the fixed policy ran no verify step: the soak exercised nothing of speculation"]
    assert speculation_problems(fixed, verify_steps=5) == []
    adaptive = ServerArgs(**{**SOAK_DEFAULTS, "speculative_policy": "adaptive"})
    assert speculation_problems(adaptive, verify_steps=0) == []  # NONE throughout is the policy's choice


def test_a_chat_template_must_be_a_file(tmp_path):
    with pytest.raises(ValueError, match="chat_template: .* is not a file"):
        ServerArgs(chat_template=str(tmp_path / "missing.jinja"))
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    assert ServerArgs(chat_template=str(template)).chat_template == str(template)


@pytest.mark.parametrize("kwargs, steps", [
    ({"speculative_num_steps": 4}, 4),
    ({"speculative_num_draft_tokens": 4}, 3),  # SGLang's count: the anchor and 3 drafts
    ({"speculative_dspark_block_size": 6}, 6),  # the deprecated alias
    ({"speculative_num_steps": 2, "speculative_num_draft_tokens": 3}, 2),
    ({}, None),
])
def test_the_draft_length_is_read_from_each_of_its_spellings(kwargs, steps):
    args = ServerArgs(speculative_algorithm="NGRAM", **kwargs)
    assert args.speculative_num_steps == steps
    assert args.speculative_num_draft_tokens == (None if steps is None else steps + 1)
    assert dataclasses.replace(args).speculative_num_steps == steps  # a resolved copy checks again


@pytest.mark.parametrize("kwargs, message", [
    ({"speculative_num_steps": 0}, r"speculative_num_steps must be in \[1, 15\]"),
    ({"speculative_num_draft_tokens": 1}, r"speculative_num_draft_tokens must be in \[2, 16\]"),
    ({"speculative_num_steps": 3, "speculative_num_draft_tokens": 3}, "give different draft lengths"),
    ({"speculative_num_steps": 3, "speculative_dspark_block_size": 4}, "give different draft lengths"),
])
def test_a_bad_or_contradicting_draft_length_names_its_flags(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        ServerArgs(speculative_algorithm="NGRAM", **kwargs)


def test_the_old_draft_length_flag_logs_its_deprecation(caplog):
    with caplog.at_level(logging.WARNING, logger="specserve.args"):
        ServerArgs(speculative_algorithm="NGRAM", speculative_dspark_block_size=3)
    assert "--speculative-dspark-block-size is deprecated: use --speculative-num-steps" in caplog.text
