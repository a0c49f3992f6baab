"""Unit tests run without the real model: loading its weights here is an error, not a slow test."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def no_real_model(monkeypatch):
    import specserve.models.loader as loader

    def refuse(*args, **kwargs):
        raise AssertionError("a unit test loaded the real model: move it to tests/integration")

    monkeypatch.setattr(loader, "_load_gguf", refuse)  # what load_model calls, wherever it was imported
    monkeypatch.setattr(loader, "_load_hf_dir", refuse)
