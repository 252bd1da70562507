"""One way to time a call: median seconds after warm-up, with CUDA events on a GPU (the
device's own clock, no host sync inside the timed region) and the wall clock elsewhere."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable


def median_seconds(fn: Callable[[], Any], device: str = "cuda", repeats: int = 10, warmup: int = 1) -> float:
    import torch

    for _ in range(warmup):
        fn()
    cuda = str(device).startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            samples.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)
