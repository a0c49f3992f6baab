"""bench offline's memory split: the torch-only process it measures holds torch and nothing more."""

from __future__ import annotations

import os

import torch

from specserve.bench.load import _rss
from specserve.bench.offline import torch_runtime_mib


def test_torch_runtime_is_a_fresh_process_with_torch_loaded():
    assert torch.__version__  # this process has torch and much else (pytest, specserve) loaded
    torch_only = torch_runtime_mib()
    assert 50 < torch_only < _rss(os.getpid()) / 2**20
