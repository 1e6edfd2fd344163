"""Timing and peak-memory helpers shared by the benchmark scripts.

Peak memory on CPU: TensorFlow exposes no allocator statistics for the host,
so a background thread samples the resident set size (RSS) every millisecond
while a phase runs; a phase's figure is its peak RSS minus the RSS when it
started. `malloc_trim` before each phase hands freed memory back to the OS so
that one phase's leftovers do not hide the next one's growth.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from typing import Callable


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _trim():
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


class PeakRss:
    """Context manager: `.peak_increase` is the peak RSS growth in bytes."""

    def __enter__(self):
        _trim()
        self.start = rss_bytes()
        self.peak = self.start
        self._running = True
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def _poll(self):
        while self._running:
            self.peak = max(self.peak, rss_bytes())
            time.sleep(0.001)

    def __exit__(self, *exc):
        self._running = False
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())
        self.peak_increase = self.peak - self.start
        return False


def time_per_call(function: Callable[[], object], warmup: int, repeats: int) -> float:
    """Median seconds per call after `warmup` calls (compilation excluded)."""
    for _ in range(warmup):
        function()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]
