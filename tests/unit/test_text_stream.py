"""Streamed text: deltas concatenate to the final text and never show a stop string."""

from __future__ import annotations

import pytest

from specserve.server.text_stream import TextStream


@pytest.fixture(scope="module")
def tokenizer():
    from specserve.tokenizer.tokenizer import load_tokenizer
    from specserve.models.loader import default_model_path

    return load_tokenizer(default_model_path())


TEXT = "The river runs past the old mill. Then it bends east, toward the sea — café ünïcode 日本語."


def stream(tokenizer, stops: list[str], chunk: int) -> tuple[list[str], str]:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    ts = TextStream(tokenizer, stops)
    deltas = [ts.add(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    full = tokenizer.decode(ids)
    cut = min([full.find(s) for s in stops if s in full], default=len(full))
    deltas.append(ts.finish(full[:cut]))
    return deltas, full[:cut]


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_deltas_concatenate_to_the_text(tokenizer, chunk):
    deltas, final = stream(tokenizer, [], chunk)
    assert "".join(deltas) == final == TEXT
    assert not any("\ufffd" in d for d in deltas)  # multi-byte characters arrive whole


@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("stop", [" bends", "mill. Then", "e"])
def test_stop_string_never_streams(tokenizer, stop, chunk):
    deltas, final = stream(tokenizer, [stop], chunk)
    assert "".join(deltas) == final
    assert stop not in "".join(deltas)
    assert final == TEXT[:TEXT.find(stop)]


def test_without_hold_back_the_stop_prefix_would_leak(tokenizer, monkeypatch):
    """Mutation: a stream that sends everything decoded shows the start of the stop string."""
    monkeypatch.setattr(TextStream, "_safe_end", lambda self, text: len(text))
    deltas, final = stream(tokenizer, ["mill. Then"], 1)
    assert "".join(deltas) != final
