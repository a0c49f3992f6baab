"""ServerArgs: speculative flags and the verify-mode environment variable."""

import pytest

from specserve.args import ServerArgs


def test_verify_mode_comes_from_flag_then_environment_then_static(monkeypatch):
    monkeypatch.delenv("SPECSERVE_RAGGED_VERIFY_MODE", raising=False)
    assert ServerArgs().verify_mode() == "static"
    monkeypatch.setenv("SPECSERVE_RAGGED_VERIFY_MODE", "compact")
    assert ServerArgs().verify_mode() == "compact"
    assert ServerArgs(speculative_dspark_verify_mode="static").verify_mode() == "static"
    monkeypatch.setenv("SPECSERVE_RAGGED_VERIFY_MODE", "ragged")
    with pytest.raises(ValueError, match="SPECSERVE_RAGGED_VERIFY_MODE"):
        ServerArgs().verify_mode()


@pytest.mark.parametrize("kwargs, field", [
    ({"speculative_algorithm": "EAGLE"}, "speculative_algorithm"),
    ({"speculative_dspark_block_size": 0}, "speculative_dspark_block_size"),
    ({"speculative_dspark_block_size": 16}, "speculative_dspark_block_size"),
    ({"speculative_algorithm": "DSPARK", "model_path": "other.gguf"}, "speculative_draft_model_path"),
    ({"speculative_dspark_verify_mode": "ragged"}, "speculative_dspark_verify_mode"),
])
def test_bad_speculative_settings_name_their_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ServerArgs(**kwargs)


def test_embedded_model_speculates_with_its_shipped_drafter():
    from specserve.assets import default_drafter_path

    shipped = default_drafter_path()
    assert shipped is not None, "the embedded model's drafter must ship with the package"
    args = ServerArgs()
    assert args.speculative_algorithm == "DSPARK" and args.speculative_draft_model_path == shipped
    assert ServerArgs(speculative_algorithm="DSPARK").speculative_draft_model_path == shipped
    assert not ServerArgs(speculative_algorithm="NONE").speculating
    assert ServerArgs(speculative_algorithm="NGRAM").speculative_draft_model_path is None
    assert ServerArgs(speculative_draft_model_path="/x").speculative_draft_model_path == "/x"
    other = ServerArgs(model_path="other.gguf")  # another target: no drafter is assumed
    assert other.speculative_algorithm is None and not other.speculating
