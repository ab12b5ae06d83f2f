"""What this machine is and does, for the adapters' tuning: read from the OS, or measured once."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any, Callable

_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def l2_cache_bytes(default: int = 2 << 20, cache_dir: str = "/sys/devices/system/cpu/cpu0/cache") -> int:
    """One core's L2 cache, as Linux reports it (sysfs, then sysconf); default elsewhere."""
    for index in sorted(Path(cache_dir).glob("index*")):
        try:
            if (index / "level").read_text().strip() == "2":
                size = (index / "size").read_text().strip()
                return int(size[:-1]) * _UNITS[size[-1]] if size[-1] in _UNITS else int(size)
        except (OSError, ValueError):
            pass
    try:
        size = os.sysconf("SC_LEVEL2_CACHE_SIZE")
        if size > 0:
            return size
    except (AttributeError, ValueError, OSError):
        pass
    return default


_MEASURED: dict = {}


def measured_faster(
    key: Any,
    first: Callable[[Any], Any],
    second: Callable[[Any], Any],
    make_input: Callable[[], Any],
    repeat: int = 5,
) -> bool:
    """Whether ``first(x)`` takes less time than ``second(x)`` on this machine (best of repeat,
    alternating), x = make_input(), measured once per key and process: a short timing at first
    use, a dict lookup after."""
    if key not in _MEASURED:
        x = make_input()
        best = [math.inf, math.inf]
        first(x), second(x)  # warm up
        for _ in range(repeat):
            for i, run in enumerate((first, second)):
                start = time.perf_counter()
                run(x)
                best[i] = min(best[i], time.perf_counter() - start)
        _MEASURED[key] = best[0] < best[1]
    return _MEASURED[key]
