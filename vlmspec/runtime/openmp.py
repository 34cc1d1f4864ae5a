"""One thread at a time on torch's CPU thread pool: giving a thread's OpenMP workers back.

On CPU, torch runs each operator on an OpenMP team, and the runtime (libgomp in the Linux wheels)
keeps a pool of worker threads per thread that ever ran an operator, after that thread stops
calling torch. Once the pools hold more threads than the machine has cores, the runtime stops
letting its threads spin between operators, and a forward of a few hundred operators pays a
wake-up on every one. The service builds its engine on the main thread and its worker thread runs
it, so every step paid it (docs/serving.md measures it: about 1.6x slower).

So a thread that has finished with torch gives its pool back (`release_thread_pool`): the
service's caller after building the engine, the worker when its batch is empty. The next operator
on a thread that gave its pool back builds a new one (a thread start, microseconds).
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Callable

import torch  # noqa: F401  (loads the OpenMP runtime that _pause_all looks for)

# libgomp (GCC's runtime, the one torch's Linux wheels link) frees only the calling thread's pool on a
# pause; what other runtimes (LLVM's libomp, Intel's libiomp5) free is not checked here, so they are left alone
RUNTIMES = ("libgomp",)
OMP_PAUSE_HARD = 2  # omp_pause_resource_kind: free the resources (threads) outright


@functools.lru_cache(maxsize=1)
def _pause_all() -> Callable[[int], int] | None:
    """omp_pause_resource_all (OpenMP 5.0) of the libgomp this process loaded, or None (none found in
    /proc/self/maps: not Linux, another OpenMP runtime, or a libgomp without it)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if line.rstrip().endswith(".so") or ".so." in line}
    except OSError:
        return None
    for path in sorted(paths):
        if os.path.basename(path).startswith(RUNTIMES):
            try:
                fn = ctypes.CDLL(path).omp_pause_resource_all  # already loaded: the same library, not a second copy
            except (OSError, AttributeError):
                continue
            fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
            return fn
    return None


def release_thread_pool() -> bool:
    """Give back the OpenMP worker threads of the calling thread's pool (see the module docstring).
    True when the runtime did; False where it is not done (no libgomp in the process, or one without
    omp_pause_resource_all), which only costs speed. Call it outside any torch operator."""
    pause = _pause_all()
    return pause is not None and pause(OMP_PAUSE_HARD) == 0


__all__ = ["release_thread_pool"]
