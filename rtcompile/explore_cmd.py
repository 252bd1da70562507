"""``rtcompile explore``: sweep order x key widths from a base spec and report, per point, the
state bytes, parameters, prefill and decode speed (measured on the GPU present, else the cost
model for a target) and, with ``--recall``, MQAR accuracy; the Pareto front marked.

Input errors (a bad option, a spec that does not load, a store that does not open) print one
line on stderr and exit 2 before any point runs.
"""

from __future__ import annotations

import os
import sys
import time

from .cli_args import (UsageError, check_out_dir, check_storage, int_list, int_list_of, new_folders, nonempty,
                       number_list_of, positive_int)

# SweepOptions / RecallOptions field -> the option that sets it (their errors name the field)
OPTION_OF = {"orders": "--orders", "widths": "--widths", "d_model": "--d-model", "match": "--match",
             "target": "--target", "workers": "--workers", "seq_len": "--seq-len", "kv_pairs": "--kv-pairs", "vocab_size": "--vocab",
             "steps": "--steps", "learning_rates": "--lrs", "seeds": "--seeds", "batch_size": "--batch-size"}
DEFAULT_OUT = "explore-results"
# the MQAR options' defaults, applied only with --recall (given without it, an option is refused:
# it was accepted and ignored)
RECALL_DEFAULTS = {"seq_len": 256, "kv_pairs": 16, "vocab": 1024, "steps": 8000, "lrs": [1e-3, 3e-3, 1e-2],
                   "seeds": [0], "batch_size": 64}


def add_parser(sub) -> None:
    from .target import PROFILES

    p = sub.add_parser("explore", help="sweep order x key widths: state, prefill/decode speed, MQAR recall, "
                                       "Pareto front (table, JSON, CSV, plots)")
    p.add_argument("spec", help="base model spec (.toml or .json): heads, value width, layers, features; each point "
                                "replaces its order and key widths")
    p.add_argument("--orders", type=int_list, required=True, metavar="O,..",
                   help="orders to sweep (2-4, the Triton kernels' orders); order o has o - 1 key axes")
    p.add_argument("--widths", type=int_list, required=True, metavar="W,..",
                   help="key-axis widths to sweep; a point's axes all have one width")
    p.add_argument("--d-model", type=positive_int, metavar="N",
                   help="model width of the base spec (default: 128 with --recall, else the spec's)")
    p.add_argument("--match", choices=["params", "state"],
                   help="params: each point's model width set so its parameters (LM with MLP, no embedding) equal "
                        "the base spec's within 2%%; state: its heads (else value width) so its state bytes do")
    p.add_argument("--target", default="auto", choices=["auto", *PROFILES],
                   help="auto (default): measure on the CUDA GPU present, else the cost model for h200; a GPU "
                        "name: the cost model for it")
    p.add_argument("--storage", metavar="URL", type=nonempty("a storage URL"),
                   help="Optuna storage the points are trials of (default: the tuner's SQLite file in the rtcompile "
                        "cache); a shared database lets several hosts split the points")
    p.add_argument("--workers", type=positive_int, metavar="N",
                   help="processes running points (default: one per visible GPU when the points use one, four "
                        "per GPU with --recall, at most one per point; else 1)")
    p.add_argument("--out", metavar="DIR", default=DEFAULT_OUT, type=nonempty("a folder path"),
                   help=f"folder for results.json, results.csv, the plots and recall checkpoints "
                        f"(default {DEFAULT_OUT})")
    r = p.add_argument_group("recall (MQAR)")
    r.add_argument("--recall", action="store_true", help="train each point on MQAR and report its accuracy")
    r.add_argument("--seq-len", type=positive_int, metavar="T", help="MQAR sequence length (default 256)")
    r.add_argument("--kv-pairs", type=positive_int, metavar="N", help="key-value pairs (default 16)")
    r.add_argument("--vocab", type=positive_int, metavar="V",
                   help="MQAR vocabulary: keys from one half, values from the other (default 1024, "
                        "the measured runs'; Zoology's is 8192)")
    r.add_argument("--steps", type=positive_int, metavar="N", help="training steps per learning rate "
                   "(default 8000; early stop at 0.99 validation accuracy)")
    r.add_argument("--lrs", type=number_list_of(float, None, "numbers"), metavar="LR,..",
                   help="learning rates swept per point, the best kept (default 1e-3,3e-3,1e-2)")
    r.add_argument("--seeds", type=int_list_of(0, "integers >= 0"), metavar="S,..",
                   help="training seeds; the accuracy reported is their mean (default 0)")
    r.add_argument("--batch-size", type=positive_int, metavar="N", help="training batch (default 64)")
    p.set_defaults(func=run)


def _options(args):
    """The sweep's options from the arguments; their ValueError / TypeError, which names a
    field, becomes a usage error naming the option."""
    from .explore.points import RecallOptions, SweepOptions

    given = [name for name in RECALL_DEFAULTS if getattr(args, name) is not None]
    if given and not args.recall:
        flag = "--" + given[0].replace("_", "-")
        raise UsageError(f"rtcompile explore: {flag}: given without --recall; allowed: with --recall (the MQAR "
                         "options set the recall training)")
    r = {name: RECALL_DEFAULTS[name] if getattr(args, name) is None else getattr(args, name) for name in RECALL_DEFAULTS}
    try:
        recall = None
        if args.recall:
            recall = RecallOptions(seq_len=r["seq_len"], kv_pairs=r["kv_pairs"], vocab_size=r["vocab"],
                                   steps=r["steps"], learning_rates=tuple(r["lrs"]), seeds=tuple(r["seeds"]),
                                   batch_size=r["batch_size"])
        return SweepOptions(orders=tuple(args.orders), widths=tuple(args.widths), d_model=args.d_model,
                            match=args.match, target=args.target, recall=recall, storage=args.storage,
                            workers=args.workers or 1)
    except (ValueError, TypeError) as exc:
        field, sep, rest = str(exc).partition(": ")
        if sep and field in OPTION_OF:
            if field == "kv_pairs":  # the pair count and the length limit each other
                rest = rest.replace("seq_len", "--seq-len")
            if field == "vocab_size":  # ... and the pair count the vocabulary
                rest = rest.replace("kv_pairs", "--kv-pairs")
            raise UsageError(f"rtcompile explore: {OPTION_OF[field]}: {rest}") from None
        raise UsageError(f"rtcompile explore: {exc}") from None


def default_workers(spec, opts) -> int:
    """``--workers`` left out: one process per visible GPU when the points use one (measured
    speed or recall), RECALL_WORKERS_PER_GPU per GPU with recall, never more than the points
    that can run; 1 without a GPU."""
    from .explore.points import base_spec, make_points
    from .explore.sweep import RECALL_WORKERS_PER_GPU, compute_device, visible_gpus

    if compute_device() != "cuda" or (opts.recall is None and opts.target != "auto"):
        return 1
    per_gpu = RECALL_WORKERS_PER_GPU if opts.recall is not None else 1
    runnable = sum(p.spec is not None for p in make_points(base_spec(spec, opts), opts))
    return max(1, min(max(1, len(visible_gpus())) * per_gpu, runnable))


def run(args) -> int:
    start = time.monotonic()
    from .spec import load_spec

    spec = load_spec(args.spec)
    opts = _options(args)
    from .explore.sweep import run_sweep

    check_storage(args.storage, create=True)  # a typo'd folder or URL: refused before any point
    check_out_dir("rtcompile explore", args.out)  # tried, nothing made
    from pathlib import Path

    from .explore.report import REPORT_FILES

    for name in REPORT_FILES:  # found only after every point had run (hours with --recall)
        if (Path(args.out) / name).is_dir():
            raise UsageError(f"rtcompile explore: --out {args.out!r}: {name} there is a folder; allowed: a folder "
                             f"whose {name} is a file or absent")
    points = Path(args.out) / "points"  # each point's checkpoints and figures (sweep.py): every point failed
    if os.path.lexists(points) and not points.is_dir():
        raise UsageError(f"rtcompile explore: --out {args.out!r}: points there is not a folder; allowed: a folder "
                         "whose points is a folder or absent")
    if args.workers is None:
        import dataclasses

        opts = dataclasses.replace(opts, workers=default_workers(spec, opts))

    def progress(point: str, what: str) -> None:
        print(f"{point}: {what} ({time.monotonic() - start:.0f} s)", file=sys.stderr, flush=True)

    from .explore.report import write_report

    # the folder made here is removed again when the sweep fails before writing anything into it
    with new_folders("rtcompile explore", args.out):
        result = run_sweep(spec, opts, args.out, progress=progress, show_training=sys.stderr.isatty())
        try:
            paths = write_report(result, args.out)
        except OSError as exc:
            raise UsageError(f"rtcompile explore: --out {args.out!r}: cannot write the report "
                             f"({exc.strerror or exc})") from None
    print(f"{result.ran} point(s) run now, {len(result.results)} of {len(result.points)} finished "
          f"(study {result.study}); wrote {', '.join(str(p) for p in paths.values())}", file=sys.stderr)
    return 0
