"""Kernel stand-ins for the tuner's tests (loaded by the trial process through --impl)."""

from __future__ import annotations

import time

from rtcompile.tuning.objective import run_kernel


def planted_wrong(bucket, variant, inp):
    """Variants with fuse_prepare compute a wrong result and look fastest: the correctness gate
    must reject them, however fast."""
    o, s = run_kernel(bucket, variant, inp)
    if variant is not None and getattr(variant, "fuse_prepare", False):
        return o * 1.01, s
    time.sleep(0.05)
    return o, s


def slow(bucket, variant, inp):
    """A correct kernel that takes long enough to be killed mid-study."""
    time.sleep(1.0)
    return run_kernel(bucket, variant, inp)


def interval_log(bucket, variant, inp):
    """Appends (pid, start, end) of every call made while the trial holds the device lock to the
    file named by RTCOMPILE_TEST_INTERVALS, and takes long enough for two workers to collide."""
    import os

    from rtcompile.tuning import store

    t0 = time.time()
    time.sleep(0.05)
    out = run_kernel(bucket, variant, inp)
    if store.HELD_DEVICE is not None:
        with open(os.environ["RTCOMPILE_TEST_INTERVALS"], "a") as fh:
            fh.write(f"{os.getpid()} {t0} {time.time()}\n")
    return out
