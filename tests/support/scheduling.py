"""The test process's CPU scheduling, kept ordinary.

SVT-AV1 (the AV1 encoder in PyAV's wheel, which builds the HDR AVIF corpus) moves the thread that
calls it to SCHED_FIFO at priority 99 when it runs as root, as CI does. Every process the test
starts afterwards (`thumbq` commands, render zygotes and children) inherits that policy, and a
real-time render busy for a minute on a 2-core machine leaves Postgres, the other xdist worker
and the test's own clock without a core: stops took 80-120 s and unrelated timing tests failed
at the same moment.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

_LINUX = hasattr(os, "sched_getscheduler")


def policy() -> tuple[int, int]:
    """This thread's scheduling policy and priority ((0, 0) where the platform has neither)."""
    if not _LINUX:
        return (0, 0)
    return os.sched_getscheduler(0), os.sched_getparam(0).sched_priority


def restore(saved: tuple[int, int]) -> None:
    if _LINUX and policy() != saved:
        os.sched_setscheduler(0, saved[0], os.sched_param(saved[1]))


@contextmanager
def kept() -> Iterator[None]:
    """Whatever the body does to this thread's scheduling is undone at its end."""
    saved = policy()
    try:
        yield
    finally:
        restore(saved)


def ordinary() -> bool:
    return not _LINUX or os.sched_getscheduler(0) == os.SCHED_OTHER
