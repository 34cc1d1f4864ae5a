"""This process's memory, as the soak and `python -m recipes kernels onednn` read it: resident (Linux /proc)
and glibc's heap (mallinfo2), which tells live allocations apart from free memory the allocator keeps;
and `release_free_memory`, which the service's worker calls to hand freed heap memory back."""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Callable


def rss_bytes() -> int:
    """This process's resident memory (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                                      "uordblks", "fordblks", "keepcost")]


@functools.lru_cache(maxsize=1)
def _mallinfo2() -> Callable[[], _MallInfo2] | None:
    """glibc's mallinfo2 (2.33+), or None (another C library, an older glibc)."""
    try:
        fn = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    return fn


def heap_bytes() -> tuple[int, int] | None:
    """(bytes malloc has handed out and not had back, bytes free inside its arenas), over all of
    glibc's arenas; None where glibc's mallinfo2 is missing. What tells a growing resident memory
    apart: live allocations (the first grows) or an allocator holding freed memory (the second)."""
    info = _mallinfo2()
    if info is None:
        return None
    m = info()
    return int(m.uordblks + m.hblkhd), int(m.fordblks)


def _libc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None (another C library, another system)."""
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _libc_trim()


def release_free_memory() -> None:
    """Hand the heap memory freed by finished requests back to the system (glibc keeps it in its
    arenas otherwise: tensors of every prompt length, freed from several threads, leave holes, and a
    long-running service's resident memory creeps up although nothing is alive: the soak,
    `vlmspec bench soak`, measures it). A no-op where malloc_trim is not available."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


__all__ = ["heap_bytes", "release_free_memory", "rss_bytes"]
