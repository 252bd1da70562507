"""The ``rtcompile`` command line.

Usage and input errors print one line on stderr and exit with code 2, never a traceback; an
interrupted command (Ctrl-C or SIGTERM, after its clean-up: no temporary file or folder left)
one line and exit code 130; a command whose stdout's reader has gone (``| head``) stops quietly
with exit code 1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import warnings
from typing import Sequence

from ._version import __version__
from .cli_args import EXIT_USAGE, Parser, UsageError, check_out_dir, int_at_least, nonempty, positive_float
from .fileio import WriteError
from .spec import SpecError, SpecFileError, SpecTypeError
from .stopping import stop_on_signal

# 128 + SIGINT, as a shell reports a Ctrl-C; a SIGTERM too (tune's since it handled one): one code for a stop
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 1  # the Python docs' recipe for a closed stdout (SIGPIPE ignored, as Python does)
__all__ = ["EXIT_BROKEN_PIPE", "EXIT_INTERRUPTED", "EXIT_USAGE", "INPUT_ERRORS", "UsageError", "build_parser", "main"]


class _NoStoreError(Exception):
    pass


def _lazy_errors() -> tuple[type, ...]:
    """Input-error types of modules a command may have loaded (the tuning store, targets,
    plans), without importing them for commands that never touch them."""
    found = []
    for mod, name in (("rtcompile.tuning.store", "StoreError"), ("rtcompile.target", "TargetError"),
                      ("rtcompile.plan", "PlanError"), ("rtcompile.export.bundle", "BundleError")):
        m = sys.modules.get(mod)
        found.append(getattr(m, name) if m is not None else _NoStoreError)
    return tuple(found)


# Errors that mean "your input is wrong" (or an output path that cannot be written, found only
# when writing: WriteError): reported as one line. Anything else is a bug and keeps its traceback.
INPUT_ERRORS = (SpecError, SpecTypeError, SpecFileError, WriteError)


def _cmd_info(args: argparse.Namespace) -> int:
    from .figures import human_bytes, human_count, summary
    from .spec import load_spec

    size = lambda n: human_bytes(n, ".2f")  # noqa: E731 -- info's two decimals
    count = lambda n: human_count(n, ".2f", ".0f")  # noqa: E731

    spec = load_spec(args.spec)
    data = summary(spec)
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    st, rec, chk, par = data["state"], data["recurrent"], data["chunk"], data["parameters"]
    f = spec.features
    title = f"{spec.name or args.spec}: order {spec.order}, key axes {'x'.join(map(str, spec.key_widths))}"
    table = Table(title=title, show_header=True, header_style="bold")
    table.add_column("figure")
    table.add_column("value", justify="right")
    rows = [
        ("key width K = prod(d_i)", f"{spec.key_dim}"),
        ("value width", f"{spec.value_width}"),
        ("heads x layers", f"{spec.heads} x {spec.layers}"),
        ("model width", f"{spec.model_width}"),
        ("update rule", f"{data['update_rule']}" + (", l2norm" if f.l2norm else "")),
        ("projection / short conv", f"{f.projection} / {f.short_conv or 'off'}"),
        ("scale", f"{data['scale']:.6g}"),
        ("state per head", f"{'x'.join(map(str, st['shape_per_head']))} {st['dtype']} = {size(st['bytes_per_head'])}"),
        ("state per sequence, one layer", size(st["bytes_per_sequence_per_layer"])),
        ("state per sequence, all layers", size(st["bytes_per_sequence"])),
        ("parameters per layer", count(par["per_layer"])),
        ("parameters (no embeddings)", count(par["model_excluding_embeddings"])),
        ("recurrent FLOPs / token / layer", count(rec["flops_per_token_per_layer"])),
        ("recurrent bytes / token / layer", size(rec["bytes_per_token_per_layer"])),
        ("recurrent FLOPs / byte", f"{rec['flops_per_byte']:.2f}"),
        (
            f"chunk (C={chk['chunk_size']}{', default' if chk['chunk_size_is_default'] else ''}) FLOPs / token / layer",
            count(chk["flops_per_token_per_layer"]),
        ),
        ("chunk bytes / token / layer", size(chk["bytes_per_token_per_layer"])),
        ("chunk FLOPs / byte", f"{chk['flops_per_byte']:.2f}"),
    ]
    for r in rows:
        table.add_row(*r)
    Console(markup=False).print(table)  # a spec's name or path is text, never markup
    return 0


def _cmd_bench_model(args: argparse.Namespace) -> int:
    """``bench --model SPEC``: the whole model's prefill and CUDA-graph decode (bench/lm.py)."""
    from pathlib import Path

    from .spec import load_spec

    if args.phase != "all":
        raise UsageError(f"rtcompile bench: --phase {args.phase} with --model; allowed: --phase only without --model "
                         "(--model times the model's prefill and decode)")
    spec = load_spec(args.model)
    from .bench import lm

    opts = lm.ModelBenchOptions(spec=spec, spec_path=args.model, quick=args.quick,
                                out=Path(args.out) if args.out is not None else None, repeats=args.repeats,
                                budget_s=args.budget_s, only=tuple(args.only or ()))
    return _bench_run(args, opts, bool(lm.model_cases(spec, opts.quick, opts.only)), "--model",
                      lm.model_dry_run_lines, lm.run_model_bench)


def _bench_run(args: argparse.Namespace, opts, matches: bool, scope: str, dry_run_lines, run) -> int:
    """What both bench modes do once their options are built: --only that matches nothing,
    --dry-run, no GPU, an unwritable --out (each a usage error before any work), then ``run``."""
    from .bench import cuda_unavailable_reason

    if opts.only and not matches:
        raise UsageError(f"rtcompile bench: --only {' '.join(opts.only)!r}: no case of {scope} matches; "
                         "allowed: parts of the case names that --dry-run lists")
    if args.dry_run:
        print("\n".join(dry_run_lines(opts)))
        return 0
    reason = cuda_unavailable_reason()
    if reason is not None:
        raise UsageError(f"rtcompile bench: {reason}")
    if opts.out is not None:
        check_out_dir("rtcompile bench", opts.out)
    run(opts)
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from pathlib import Path

    if args.model is not None:
        return _cmd_bench_model(args)
    from . import bench

    opts = bench.BenchOptions(
        phase=args.phase, quick=args.quick, out=Path(args.out) if args.out is not None else None,
        repeats=args.repeats, budget_s=args.budget_s, only=tuple(args.only or ()),
    )
    return _bench_run(args, opts, bool(bench.plan(opts.phase, opts.quick, opts.variants, opts.only)),
                      f"phase {opts.phase}", bench.dry_run_lines, bench.run_bench)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="rtcompile",
        description="Autotune, plan and export RunningTensor (higher-order linear attention) models.",
    )
    parser.add_argument("--version", action="version", version=f"rtcompile {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    info = sub.add_parser("info", help="print a spec's derived figures (state size, parameters, FLOPs, bytes)")
    info.add_argument("spec", help="model spec file (.toml or .json)")
    info.add_argument("--json", action="store_true", help="print the figures as JSON")
    info.set_defaults(func=_cmd_info)
    # bench imports only the standard library and our spec/figures at module level (no torch).
    from .bench import DEFAULT_BUDGET_S, DEFAULT_REPEATS, MIN_REPEATS, PHASES

    bench = sub.add_parser(
        "bench",
        help="time our kernels, the PyTorch reference and fla on one CUDA GPU (see benchmarks/README.md)",
    )
    bench.add_argument("--phase", choices=PHASES, default="all",
                       help="what to measure (default all = prefill + decode; train: forward + backward, only when named)")
    bench.add_argument("--model", metavar="SPEC",
                       help="time the whole model of a spec file instead: prefill tokens/s (B1, B8 at T4096) and "
                       "CUDA-graph decode tokens/s (B1, B32, B256), ours and fla's mixer where K <= 256")
    bench.add_argument("--quick", action="store_true", help="T=1024 and fewer cases (a smoke run)")
    bench.add_argument("--out", metavar="DIR", type=nonempty("a folder path"), help="write bench.json and bench.csv (model.json and model.csv with "
                       "--model) into DIR (rewritten after every case)")
    bench.add_argument("--dry-run", action="store_true", help="list the cases a run would measure; needs no GPU")
    bench.add_argument("--repeats", type=int_at_least(MIN_REPEATS), default=DEFAULT_REPEATS, metavar="N",
                       help=f"timed repeats per measurement, median reported (default {DEFAULT_REPEATS})")
    bench.add_argument("--budget-s", type=positive_float, default=DEFAULT_BUDGET_S, metavar="S",
                       help="soft time budget: once spent, the remaining implementations are recorded as skipped "
                       f"(default {DEFAULT_BUDGET_S:.0f})")
    bench.add_argument("--only", action="append", metavar="TEXT",
                       help="measure only the cases whose name contains TEXT (repeatable; see --dry-run for names)")
    bench.set_defaults(func=_cmd_bench)
    from . import explore_cmd, export_cmd, plan_cmd, tune_cmd

    tune_cmd.add_parser(sub)
    plan_cmd.add_parsers(sub)
    export_cmd.add_parsers(sub)
    explore_cmd.add_parser(sub)
    return parser


def _stdout_gone() -> int:
    """stdout's reader has gone (``rtcompile plan --json | head -1``): stop quietly, as the
    Python docs' recipe does. stdout is pointed at devnull, so the interpreter's flush at exit
    does not fail on the closed pipe again ("Exception ignored ... BrokenPipeError")."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # no file descriptor (a captured stdout): nothing is flushed to it
        pass
    return EXIT_BROKEN_PIPE


@contextlib.contextmanager
def _one_line_warnings():
    """Each warning a command raises as one ``rtcompile: warning:`` line on stderr, once per text
    (Python's form, "<file>:<line>: RuntimeWarning: ..." and the source line, named our module to
    a user; an unreadable tuned table warned twice in `build`). Only the format changes, so a
    caller recording warnings (``pytest.warns``) still receives them."""
    shown: set[str] = set()

    def one_line(message, category, filename, lineno, line=None) -> str:
        text = str(message).splitlines()[0] if str(message) else category.__name__
        if text in shown:
            return ""
        shown.add(text)
        return f"rtcompile: warning: {text}\n"

    before = warnings.formatwarning
    warnings.formatwarning = one_line
    try:
        yield
    finally:
        warnings.formatwarning = before


def _error_line(prog: str, message: str) -> str:
    """argparse's form for every refusal, usage or input: ``<prog>: error: <first line>``."""
    return f"{prog}: error: {message.splitlines()[0] if message else 'refused'}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    prog = "rtcompile"  # "rtcompile <command>" once the command is known
    try:
        # every command: a SIGTERM stops it as a Ctrl-C does, through its clean-up (Python's default
        # ended `export` at once, leaving its temporary bundle folder and the folders it had made)
        with stop_on_signal(), _one_line_warnings():
            args = parser.parse_args(argv)
            if args.command is None:
                raise UsageError("rtcompile: missing COMMAND; run 'rtcompile --help' for the list")
            prog = f"rtcompile {args.command}"
            code = args.func(args)
            sys.stdout.flush()  # a closed pipe is found here, where it is handled, not at exit
        return code
    except BrokenPipeError:
        return _stdout_gone()
    except UsageError as exc:  # its text starts with the parser's prog ("rtcompile tune: ...")
        head, sep, rest = str(exc).partition(": ")
        print(_error_line(head, rest) if sep and head.startswith("rtcompile") else _error_line(prog, str(exc)),
              file=sys.stderr)
        return EXIT_USAGE
    except (*INPUT_ERRORS, *_lazy_errors()) as exc:
        print(_error_line(prog, str(exc)), file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM, after the commands' own clean-up
        print(f"rtcompile: interrupted{_then(exc.__cause__)}", file=sys.stderr)
        return EXIT_INTERRUPTED


def _then(error: BaseException | None) -> str:
    """The error a stop ended in, for the stop's line (rtcompile.stopping ends a stopped command
    that failed as the stop, from that error): a clean-up that failed after a stop (a temporary
    folder not removed) says so there, where a traceback said it before."""
    if error is None:
        return ""
    text = str(error).splitlines()
    return f"; then {type(error).__name__}" + (f": {text[0]}" if text else "")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
