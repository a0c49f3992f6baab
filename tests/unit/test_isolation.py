"""The unit suite's own guard: a unit test that loads the real model fails instead of running slowly."""

import pytest


def test_loading_the_real_model_in_a_unit_test_fails():
    from specserve import Engine

    with pytest.raises(AssertionError, match="unit test loaded the real model"):
        Engine(dtype="float32", max_total_tokens=64)
