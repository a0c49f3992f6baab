"""The read-bandwidth probe (bench/bandwidth.py, csrc stream_read) reads every byte it is given,
and the bandwidth share is the weights streamed per second over the probe's figure."""

from __future__ import annotations

import pytest
import torch

from specserve.bench.bandwidth import read_bandwidth_gbs, share_of_bandwidth
from specserve.kernels.build import load


def test_stream_read_sums_every_word_of_the_buffer():
    buffer = torch.arange(64 * 5000, dtype=torch.int64).to(torch.uint8)  # bytes 0..255 repeating
    expected = int(buffer.view(torch.int64).sum())  # both sums wrap modulo 2^64
    assert load().stream_read(buffer) == expected
    half = buffer.clone()
    half[len(half) // 2 :] = 0  # a probe that skipped the second half would read this buffer's sum
    assert load().stream_read(half) != expected


def test_stream_read_refuses_a_buffer_of_partial_lines():
    with pytest.raises(RuntimeError, match="whole 64-byte lines"):
        load().stream_read(torch.zeros(100, dtype=torch.uint8))


def test_the_probe_reports_a_positive_rate_and_the_share_is_bytes_per_second_over_it():
    assert read_bandwidth_gbs(size=8 << 20, passes=2) > 0
    assert share_of_bandwidth(1e9, 30.0, 40.0) == pytest.approx(0.75)
