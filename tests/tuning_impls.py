"""Kernel stand-ins for the tuner's tests (loaded by the trial process through --impl)."""

from __future__ import annotations

import os
import time

from rtcompile.tuning.objective import run_kernel


def planted_wrong(bucket, variant, inp):
    """Configs of the fused form compute a wrong result and look fastest: the correctness gate
    must reject them, however fast."""
    o, s = run_kernel(bucket, variant, inp)
    if variant is not None and variant.form == "fused":
        return o * 1.01, s
    time.sleep(0.05)
    return o, s


def slow(bucket, variant, inp):
    """A correct kernel that takes long enough to be killed mid-study. As each call starts it
    appends its start time to the file named by RTCOMPILE_TEST_STARTED (when set), so a test
    can aim a kill inside a call, hence inside a timed trial, and its process id to the file
    named by RTCOMPILE_TEST_PIDS (when set)."""
    if os.environ.get("RTCOMPILE_TEST_STARTED"):
        with open(os.environ["RTCOMPILE_TEST_STARTED"], "a") as fh:
            fh.write(f"{time.time()}\n")
    if os.environ.get("RTCOMPILE_TEST_PIDS"):  # the trial processes, for a test that they all end
        with open(os.environ["RTCOMPILE_TEST_PIDS"], "a") as fh:
            fh.write(f"{os.getpid()}\n")
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


def hang_at_c32(bucket, variant, inp):
    """Chunk size 32 hangs (a stuck compile or kernel): the trial must time out alone."""
    if variant is not None and variant.chunk_size == 32:
        time.sleep(3600)
    return run_kernel(bucket, variant, inp)


def crash_at_c32(bucket, variant, inp):
    """Chunk size 32 kills its process (as a CUDA fault would): that trial fails, the next runs."""
    import os

    if variant is not None and variant.chunk_size == 32:
        os._exit(3)
    return run_kernel(bucket, variant, inp)


def pid_tagged(bucket, variant, inp):
    """A correct kernel that prints the trial process's pid (the runner must skip such lines)."""
    import os

    print(f"pid {os.getpid()}", flush=True)
    return run_kernel(bucket, variant, inp)


_PLANTED_RUNS: dict = {}


def planted_wrong_backward(bucket, variant, inp):
    """Train trials (kernel chunk_bwd): chunk size 16 returns a wrong first key factor's gradient
    (1% off); chunk size 64 is correct and slow; chunk size 32 correct and fast. The gate must
    reject C 16 whatever its speed, so C 32 wins.

    The speeds are planted, not measured: the first call on each input set runs the real backward
    (its check, and the timing's warm-up), later calls return that result after a planted sleep.
    Under a loaded interpreter the real C 32 and C 64 runs differ by more than any sleep that would
    keep the test short (CI once timed C 64 faster with 0.2 s planted on top of the real run)."""
    from rtcompile.tuning.train_objective import run_train

    c = None if variant is None else variant.chunk_size
    key = (id(inp), c)
    if key not in _PLANTED_RUNS:
        _PLANTED_RUNS[key] = (inp, run_train(bucket, variant, inp))  # keep inp alive: ids stay unique
    else:
        time.sleep(0.01 if c in (16, 32) else 0.2)
    out = _PLANTED_RUNS[key][1]
    return {**out, "dk0": out["dk0"] * 1.01} if c == 16 else out


def missing_gradient(bucket, variant, inp):
    """A train trial that drops dbeta (as a backward that silently skipped it would)."""
    from rtcompile.tuning.train_objective import run_train

    out = run_train(bucket, variant, inp)
    out.pop("dbeta")
    return out


def planted_unwritten(bucket, variant, inp):
    """A config that leaves its output's last element unwritten: what that element holds is
    whatever its memory held (often the previous call's correct value, which the allocator hands
    back); the correctness gate poisons outputs so the element fails the check."""
    from rtcompile.kernels import args

    o, s = run_kernel(bucket, variant, inp)
    earlier = args.empty_like(o)  # an earlier output of this size, correct, then freed: the
    earlier.copy_(o)  # allocator's next block of the size is most likely this one
    del earlier
    out = args.empty_like(o)
    out.view(-1)[:-1] = o.reshape(-1)[:-1]
    return out, s


def rounded_reference(bucket, variant, inp):
    """A correct kernel in the bucket's dtype without running one (fast at T 4096 in the
    interpreter): the float64 result, rounded to the inputs' dtype."""
    from rtcompile.tuning.objective import reference

    ref = reference(bucket, inp)
    return ref["o"].to(inp.v.dtype), ref["s"].float()


def zeroed_row(bucket, variant, inp):
    """:func:`rounded_reference` with token T/2 of every sequence zeroed: a kernel that drops
    one row, small in the global error at long T."""
    o, s = rounded_reference(bucket, variant, inp)
    o = o.clone()
    o[:, o.shape[1] // 2] = 0
    return o, s
