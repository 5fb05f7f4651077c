"""A process's resident memory on Linux, for peak-memory measurements on CPU ranks (no allocator statistics there).

:func:`reset_peak` frees what can be freed (garbage collection, then glibc's ``malloc_trim`` returns the freed heap
to the system) and resets the kernel's peak-RSS mark (``/proc/self/clear_refs``, Linux >= 4.0); :func:`peak_bytes`
reads the peak since. Their difference around a piece of work is what it added on top of what was resident.
"""

from __future__ import annotations

import ctypes
import gc
import sys
from pathlib import Path

STATUS = Path("/proc/self/status")


def _status_bytes(field: str) -> int:
    if not sys.platform.startswith("linux"):
        raise RuntimeError("resident-memory measurement reads /proc/self (Linux only)")
    for line in STATUS.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024  # the kernel reports kB
    raise RuntimeError(f"{STATUS} has no {field} line")


def reset_peak() -> int:
    """Free what can be freed, reset the peak-RSS mark; the resident bytes now (the baseline)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc: freed heap may stay resident, the baseline is higher
        pass
    Path("/proc/self/clear_refs").write_text("5")  # "5": reset the peak resident set size to the current one
    return _status_bytes("VmRSS")


def peak_bytes() -> int:
    """The peak resident bytes since the last :func:`reset_peak`."""
    return _status_bytes("VmHWM")
