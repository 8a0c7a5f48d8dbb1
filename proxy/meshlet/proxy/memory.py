"""Gives the heap memory a burst freed back to the system.

Bodies in flight are Python bytes above pymalloc's 512-byte limit, so they come from glibc's
malloc; once freed, glibc keeps the pages for reuse and the process's RSS stays at the burst's
peak for good (200 stalled HTTP/2 downloads took a one-hop proxy from 32 to 75 MiB, and it stayed
at 75 when they were gone). Every TRIM_EVERY seconds `malloc_trim(0)` returns the free pages:
measured, 0.05 ms when there is nothing to return and about 2 ms for 40 MiB, against the
seconds between calls. Where the C library has no malloc_trim (musl), nothing is done.

Since the trimmer returns what a burst freed, glibc need not do it on each free: `keep_pages`
raises its thresholds. With its defaults, a relay's buffers (uvloop reads up to 256 KiB at a time;
TLS records come out of OpenSSL as large) were mapped and unmapped, or the heap's top given back
and grown again (4,700 `brk` calls in 4 s of one proxy of a meshed pair carrying bulk TCP), and
every page faulted in again: page faults were 15 % of the server-side proxy's CPU samples. With
the thresholds raised, the pair's CPU per MiB fell to 0.81x (2,269 µs against 2,797 in one run,
bench.proxy); its HTTP rows did not move.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
from collections.abc import Callable
from typing import Final

log = logging.getLogger(__name__)

TRIM_EVERY: Final = 10.0  # seconds
# Blocks up to this size come from the heap, not from a mapping of their own (glibc: 128 KiB,
# moving up as mapped blocks are freed).
MMAP_THRESHOLD: Final = 4 << 20
# Free memory at the heap's top is given back past this much (glibc: twice the above); the
# trimmer gives back the rest every TRIM_EVERY seconds.
TRIM_THRESHOLD: Final = 64 << 20
_M_TRIM_THRESHOLD: Final = -1  # mallopt's parameters (malloc.h)
_M_MMAP_THRESHOLD: Final = -3


def malloc_trim() -> Callable[[], bool] | None:
    """The C library's `malloc_trim(0)` (True: memory was returned), or None without one.
    (Looked up among the symbols the process already has, as dlopen(NULL) sees them:
    ctypes.util's search would cost 3.5 MiB of imports.)"""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return lambda: bool(trim(0))


def keep_pages() -> bool:
    """Raises glibc's thresholds (MMAP_THRESHOLD, TRIM_THRESHOLD) so that freed buffers stay
    in the heap for the next ones; for a process that runs `trim_forever`. False where the C
    library has no mallopt or refuses them."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )


async def trim_forever(trim: Callable[[], bool], every: float = TRIM_EVERY) -> None:
    """Trims the heap every `every` seconds, until cancelled."""
    while True:
        await asyncio.sleep(every)
        if trim():
            log.debug("freed heap memory returned to the system")
