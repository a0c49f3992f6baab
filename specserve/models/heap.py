"""The C heap's free pages handed back to the OS.

glibc serves allocations below its mmap threshold from its heap and keeps what is freed there;
the threshold grows as large blocks are freed (up to 32 MB), so loading, which frees a few MB of
parsed codes and packing temporaries per weight, would otherwise leave them all resident; so
would a busy spell's step temporaries (logits, prefill chunks), which the serving loop hands back
when it next goes idle (server/engine_process.py). Off glibc this is a no-op.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any, Optional


@functools.lru_cache(maxsize=1)
def _libc() -> Optional[Any]:
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def release_free_heap() -> None:
    """Return the heap's free pages to the OS (malloc_trim; about a millisecond)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
