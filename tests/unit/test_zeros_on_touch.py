"""The request-to-token table's memory: zeros whose pages become resident only when written."""

from __future__ import annotations

import os

import torch

from specserve.kv.pool import ReqToTokenPool, zeros_on_touch

MIB = 2**20


def resident_bytes(t: torch.Tensor) -> int:
    """Bytes of the tensor's pages that are present and this process's own (bits 63 and 56 of
    /proc/self/pagemap; a page only read maps the kernel's shared zero page, which is not)."""
    page = os.sysconf("SC_PAGE_SIZE")
    first = t.data_ptr() // page
    last = (t.data_ptr() + t.numel() * t.element_size() - 1) // page
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        entries = f.read((last - first + 1) * 8)
    present = sum(1 for i in range(0, len(entries), 8) if entries[i + 7] & 0x81 == 0x81)
    return present * page


def test_zeros_on_touch_reads_zero_and_becomes_resident_where_written():
    t = zeros_on_touch((64, MIB // 8), torch.int64)  # 64 MiB
    assert t.shape == (64, MIB // 8) and t.dtype == torch.int64 and t.is_contiguous()
    assert int(t[5].abs().sum()) == 0 and int(t[63, -1]) == 0  # reads see zeros ...
    assert resident_bytes(t) < 8 * MIB  # ... without making the table resident
    t[3, :100] = 7
    assert int(t.sum()) == 700
    assert resident_bytes(t) < 8 * MIB  # one written row: its pages only (a huge page at most)
    t.fill_(1)
    assert resident_bytes(t) >= 64 * MIB


def test_torch_zeros_would_make_every_page_resident():
    """The mutation the table's allocation guards against: torch.zeros writes every page."""
    t = torch.zeros(64, MIB // 8, dtype=torch.int64)
    assert resident_bytes(t) >= 64 * MIB


def test_the_cpu_table_is_allocated_on_touch():
    pool = ReqToTokenPool(65, 32776)
    assert resident_bytes(pool.table) < 8 * MIB
    pool.write(1, 0, [5, 6, 7])
    assert pool.table[1, :4].tolist() == [5, 6, 7, 0]


def test_an_empty_table_is_a_plain_empty_tensor():
    assert zeros_on_touch((0, 16), torch.int64).shape == (0, 16)
