"""``rtcompile tune``: tune a spec's kernels for this machine, or list what the store holds."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

from .cli_args import (UsageError, check_cache_writable, check_storage, finite_positive_float, fixed_param, int_list,
                       nonempty, positive_int, tuning_buckets)
from .fields import FieldError

# TuneOptions field -> the option that sets it (its errors name the field)
OPTION_OF = {"trials": "--trials", "seconds": "--seconds", "workers": "--workers", "trial_timeout": "--timeout",
             "impl": "--impl", "fixed": "--fix", "storage": "--storage"}

# the phase that tunes each kernel (--fix names a kernel's forms)
PHASE_OF = {"chunk": "prefill", "recurrent": "decode", "chunk_bwd": "train"}


def add_parser(sub) -> None:
    p = sub.add_parser("tune", help="autotune a spec's kernels for this GPU (Optuna; results kept in a store)")
    p.add_argument("spec", nargs="?", help="model spec file (.toml or .json); omit with --list")
    p.add_argument("--list", action="store_true", help="list the studies the store holds")
    p.add_argument("--target", default="auto", choices=["auto"],
                   help="tune for the GPU present (named targets come with the planner)")
    p.add_argument("--storage", metavar="URL", type=nonempty("a storage URL"),
                   help="Optuna storage: a SQLAlchemy URL (sqlite:///f.db, postgresql://...) or journal:PATH "
                        "(default: a SQLite file in the rtcompile cache)")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--trials", type=positive_int, metavar="N", help="trials per kernel and bucket (default 20)")
    budget.add_argument("--seconds", type=finite_positive_float, metavar="S",
                        help="time budget of the whole command, shared evenly by the kernels and buckets (a trial "
                             "running at the end is finished)")
    budget.add_argument("--exhaustive", action="store_true",
                        help="one trial per valid config of the space, every form (a separate study: the reference a "
                             "TPE study is judged against)")
    p.add_argument("--fix", type=fixed_param, action="append", default=[], metavar="NAME=VALUE",
                   help="hold the kernel form (form=NAME) or one of a form's fields (FORM.FIELD=VALUE, e.g. "
                        "resident.chunk_size=32) at one value (repeatable): tune a sub-space. A form belongs to one "
                        "kernel, so name its phase: --phase prefill for the chunk forms (resident, streamed, fused, "
                        "split), decode for recurrent, train for backward; with --phase all a --fix is refused")
    p.add_argument("--workers", type=positive_int, metavar="N",
                   help="worker processes (default: one per visible GPU, 1 on the CPU); more workers than "
                        "GPUs overlap their compiles, while timings stay one at a time per GPU")
    again = p.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true",
                       help="continue finished studies for --trials N more trials each (a killed run needs no flag: "
                            "the same command again finishes its budget)")
    again.add_argument("--retune", action="store_true", help="delete this machine's studies for the spec and start over")
    p.add_argument("--phase", choices=["prefill", "decode", "train", "all"], default="all",
                   help="tune the chunk (prefill) kernel, the recurrent (decode) kernel, or both (all); train: the "
                        "chunk backward's configs, forward + backward timed together and every gradient checked "
                        "against float64 (not part of all: a trial costs a forward and a backward)")
    p.add_argument("--batch", type=int_list, metavar="B,..",
                   help="prefill / train batch buckets (GPU default 8; CPU 1)")
    p.add_argument("--seq-len", type=int_list, metavar="T,..",
                   help="prefill / train length buckets (GPU default 4096; CPU 32)")
    p.add_argument("--decode-batch", type=int_list, metavar="B,..",
                   help="decode batch buckets (GPU default 32,256; CPU 2)")
    p.add_argument("--timeout", type=finite_positive_float, default=300.0, metavar="S",
                   help="per-trial limit: compile, check and time (default 300)")
    p.add_argument("--impl", help=argparse.SUPPRESS)  # test hook: "module:function" replacing the kernel call
    p.set_defaults(func=run)


def _list(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from .tuning import list_studies

    check_storage(args.storage, create=False)  # a file that is not a store: one line, nothing made

    rows = list_studies(args.storage)
    from .tuning.store import default_url

    table = Table(title=f"tuning store: {args.storage or default_url()}", header_style="bold")
    for c in ("study", "trials run", "best ms", "default ms", "best variant"):
        table.add_column(c)
    for r in rows:
        ms = lambda s: f"{s * 1e3:.4g}" if s else "-"
        v = r["best_variant"]
        vt = " ".join(f"{k}={x}" for k, x in v.items() if k != "kernel") if v else "(not finished)"
        table.add_row(r["study"], str(r["trials"]), ms(r["best_seconds"]), ms(r["default_seconds"]), vt)
    Console(width=200, markup=False).print(table)  # store paths, names and configs are text, never markup
    if not rows:
        print("the store holds no rtcompile studies", file=sys.stderr)
    return 0


def run(args) -> int:
    from .tuning.processes import stop_on_signal

    with stop_on_signal():  # a kill stops the workers and trial processes too (study._run_workers)
        return _run(args)


def _unused_options(args) -> None:
    """A UsageError for options this command would ignore: with --list, anything but --storage;
    the prefill / train buckets (--batch, --seq-len) under --phase decode; the decode buckets
    (--decode-batch) under --phase prefill or train (each was accepted and ignored)."""
    given = {"SPEC": args.spec is not None, "--trials": args.trials is not None, "--seconds": args.seconds is not None,
             "--exhaustive": args.exhaustive, "--fix": bool(args.fix), "--workers": args.workers is not None,
             "--resume": args.resume, "--retune": args.retune, "--phase": args.phase != "all",
             "--batch": args.batch is not None, "--seq-len": args.seq_len is not None,
             "--decode-batch": args.decode_batch is not None}
    if args.list and (extra := [k for k, v in given.items() if v]):
        raise UsageError(f"rtcompile tune: --list lists the store and takes only --storage, got {', '.join(extra)}")
    if args.phase == "decode" and (extra := [k for k in ("--batch", "--seq-len") if given[k]]):
        raise UsageError(f"rtcompile tune: {', '.join(extra)}: prefill and train buckets, unused by --phase decode; "
                         "allowed: --decode-batch")
    if args.phase in ("prefill", "train") and given["--decode-batch"]:
        raise UsageError(f"rtcompile tune: --decode-batch: decode buckets, unused by --phase {args.phase}; "
                         "allowed: --batch, --seq-len")


def _run(args) -> int:
    _unused_options(args)
    if args.list:
        return _list(args)
    if not args.spec:
        raise UsageError("rtcompile tune: give a SPEC file, or --list")
    _check_fix_repeats(args.fix)
    start = time.time()  # --seconds counts from here: imports, studies, compiles, checks and all
    import torch
    from rich.console import Console

    from .spec import load_spec
    from .tuning import TuneOptions, device_refusal_of_space, refusal, search_space

    spec = load_spec(args.spec)
    check_storage(args.storage, create=True)  # a typo'd folder or URL: refused before any notice or trial
    check_cache_writable("rtcompile tune")  # the tuned table is written after the trials: tried before them
    on_gpu = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
    err = Console(stderr=True)
    if not on_gpu:
        os.environ["TRITON_INTERPRET"] = "1"  # workers and trials inherit it
    from .functional import MAX_TRITON_ORDER

    if spec.order > MAX_TRITON_ORDER:
        raise UsageError(f"rtcompile tune: order {spec.order}; the Triton kernels take orders 2-{MAX_TRITON_ORDER}")
    workers = args.workers or (max(1, torch.cuda.device_count()) if on_gpu else 1)
    try:
        opts = TuneOptions(storage=args.storage, trials=None if args.seconds else (args.trials or 20),
                           seconds=args.seconds, workers=workers, resume=args.resume, retune=args.retune,
                           device="cuda" if on_gpu else "cpu", trial_timeout=args.timeout, impl=args.impl,
                           repeats=20 if on_gpu else 3, fixed=dict(args.fix), exhaustive=args.exhaustive)
    except FieldError as exc:  # a bound the parser does not hold (--workers <= MAX_WORKERS): named as the option
        raise UsageError(f"rtcompile tune: {OPTION_OF.get(exc.name, exc.name)}: {str(exc).partition(': ')[2]}") from None
    buckets = tuning_buckets(spec, args.phase, args.batch, args.seq_len, args.decode_batch, on_gpu)
    _check_sizes(spec, buckets, on_gpu)
    for bucket in buckets:  # a shape the kernel cannot run, or a bad --fix: usage errors before any study starts
        if (reason := refusal(bucket)) is not None:
            raise UsageError(f"rtcompile tune: --phase {args.phase}: {reason}")
        _check_fix_phase(args, bucket)
        try:
            search_space(bucket, opts)
        except ValueError as exc:
            raise UsageError(f"rtcompile tune: --fix: {exc}") from None
        if opts.fixed and (reason := device_refusal_of_space(bucket, opts)) is not None:
            raise UsageError(f"rtcompile tune: --fix: no config of the fixed sub-space runs on this machine "
                             f"({opts.device}): {reason}")
    from .tuning import open_storage

    open_storage(opts.storage)  # a store that does not open: one line, before the notice
    if not on_gpu:  # on stdout, with the results: an error after it stays exactly one stderr line
        Console().print("[yellow]no CUDA GPU: tuning runs the Triton interpreter on the CPU with small shapes; "
                        "CPU timings are not GPU timings[/]")
    _rebuild_unreadable_table(opts, err)
    results = _tune_all(buckets, opts, err, start)
    _print_results(results, spec, args, on_gpu)
    if any(r.table_written for r in results if r.already_tuned):
        print("already tuned, but the tuned-config table lacked the winner: rewritten from the store")
    elif all(r.already_tuned for r in results):
        print("already tuned for this machine: 0 trials run (--resume to continue, --retune to start over)")
    return 0


def _memory_target(on_gpu: bool):
    """What the tuning shapes must fit: the GPU present, or on the CPU the host's memory (with
    the default target's other figures, which the size check reads for the workspace)."""
    import dataclasses

    from .target import DEFAULT_TARGET, detect, get_target

    if on_gpu:
        return detect()
    base = get_target(DEFAULT_TARGET)
    try:
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # no sysconf figures (not Linux / macOS)
        return base
    return dataclasses.replace(base, name="this host", memory_bytes=host)


def _check_sizes(spec, buckets, on_gpu: bool) -> None:
    """The planner's memory check (``plan.check_memory``, as ``rtcompile plan`` refuses the same
    shapes) on every bucket, before a study starts: a trial at 10^9 tokens would try to allocate
    tens of GiB and be recorded as failed."""
    from .plan import PlanError, check_memory

    target = _memory_target(on_gpu)
    for b in buckets:
        try:
            check_memory(spec, target, b.batch, b.seq_len)
        except PlanError as exc:
            opt = "--decode-batch" if b.kernel == "recurrent" else "--batch / --seq-len"
            why = str(exc).removeprefix("plan: ")
            raise UsageError(f"rtcompile tune: {opt}: the {b.kernel} bucket (sizes rounded up to powers of two) "
                             f"{why}") from None


def _check_fix_repeats(fix: list[tuple[str, object]]) -> None:
    """A field held twice (``--fix form=split --fix form=fused``): a usage error naming it. The
    sub-space holds one value of a field; the last one was kept silently, under a title that
    named both."""
    seen: dict[str, object] = {}
    for key, value in fix:
        if key in seen:
            raise UsageError(f"rtcompile tune: --fix {key}: given twice ({key}={seen[key]}, {key}={value}); "
                             "allowed: one value per field")
        seen[key] = value


def _check_fix_phase(args, bucket) -> None:
    """A --fix naming a form of another kernel than ``bucket``'s, under --phase all (which tunes
    more than one kernel): a usage error that names the phase the form belongs to."""
    from .kernels.forms import KERNELS

    if args.phase != "all":
        return  # one kernel: search_space's message names its forms
    for key, value in args.fix:
        form = str(value) if key == "form" else key.partition(".")[0]
        owner = next((k for k, classes in KERNELS.items() if form in (c.form for c in classes)), None)
        if owner is not None and owner != bucket.kernel:
            raise UsageError(f"rtcompile tune: --fix {key}={value}: the {form} form belongs to the {owner} kernel, "
                             f"which --phase {PHASE_OF[owner]} tunes, and --phase all tunes the {bucket.kernel} "
                             f"kernel too; allowed: --phase {PHASE_OF[owner]} with this --fix")


def _rebuild_unreadable_table(opts, err) -> None:
    """A tuned-config table that cannot be read (corrupt, an older format) is rebuilt from the
    store now, before any trial: it is derived data, and the store holds every winner."""
    from .tuning import open_storage
    from .tuning.store import table_problem, write_tuned

    if (problem := table_problem(opts.table)) is not None:
        path = write_tuned([], opts.table, rebuild_from=open_storage(opts.storage))
        err.print(f"{problem}: rebuilt from the tuning store ({path})", markup=False, highlight=False)


def _tune_all(buckets, opts, err, start: float) -> list:
    """Each bucket's study in turn, with a progress bar on a terminal, else one line per
    finished trial. With --seconds, bucket i must end by start + S (i + 1) / n (a bucket that
    overruns takes the time from the next ones, so the command ends on time)."""
    from rich.markup import escape
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from .tuning import tune_bucket

    def budget(i: int):
        if opts.seconds is None:
            return opts
        return dataclasses.replace(opts, deadline=start + opts.seconds * (i + 1) / len(buckets))

    if not err.is_terminal:
        last: dict[str, int] = {}

        def line(label: str, done: int, total: int) -> None:
            # one line per finished trial, also when two finished between polls; the first report of
            # a resumed study states its count once
            first = last.get(label, done - 1 if done else 0)
            of = f"/{total}" if total else ""
            for n in range(first + 1, done + 1):
                print(f"{label}: {n}{of} trials run ({time.time() - start:.0f} s)", file=sys.stderr, flush=True)
            last[label] = max(done, last.get(label, 0))

        return [tune_bucket(b, budget(i), line) for i, b in enumerate(buckets)]
    results = []
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err, transient=False) as bar:
        tasks: dict[str, int] = {}

        def progress(label: str, done: int, total: int) -> None:
            if label not in tasks:
                tasks[label] = bar.add_task(escape(label), total=total or None)
            bar.update(tasks[label], completed=done, total=total or None)

        for i, bucket in enumerate(buckets):
            results.append(tune_bucket(bucket, budget(i), progress))
    return results


def _print_results(results, spec, args, on_gpu: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    from .kernels.forms import FORMS
    from .tuning.space import in_subspace

    how = ("exhaustive sweep" if args.exhaustive else "tuned") + (f" (fixed: {', '.join(f'{k}={v}' for k, v in args.fix)})"
                                                                   if args.fix else "")
    table = Table(title=f"{how} {spec.name or args.spec} on {'GPU' if on_gpu else 'CPU (interpreter timings)'}",
                  header_style="bold")
    # "trials run": the study's, every run's (as `tune --list` shows it); "this run": this command's
    for c in ("bucket", "trials run", "this run", "ok", "pruned", "rejected", "failed", "best ms", "default ms",
              "speed-up", "best variant"):
        table.add_column(c)
    # stale: a killed worker's trial, retried (its retry is counted instead): not a trial run
    failed = lambda c: str(c.get("failed", 0)) + (f" (+{c['stale']} stale)" if c.get("stale") else "")
    fixed = dict(args.fix or ())
    for r in results:
        c = r.counts
        ms = lambda s: f"{s * 1e3:.4g}" if s else "-"
        v = r.best_variant or {}
        vt = " ".join(f"{k}={x}" for k, x in v.items() if k != "kernel")
        if fixed and v and not in_subspace(FORMS[v["form"]].from_dict(v), fixed):
            vt += " (the default, outside the fixed sub-space: none of it was faster)"
        ran = "0 (already tuned)" if r.already_tuned else str(r.trials_run)
        pruned = str(c.get("pruned", 0)) + (f" (+{c['repeat']} repeats)" if c.get("repeat") else "")
        table.add_row(r.bucket.label, str(r.trials_total), ran, str(c.get("ok", 0)), pruned,
                      str(c.get("rejected", 0)), failed(c), ms(r.best_seconds),
                      ms(r.default_seconds), f"{r.speedup:.2f}x" if r.speedup else "-", vt)
    Console(width=200, markup=False).print(table)  # a spec's name or path is text, never markup
