"""``rtcompile plan`` (decide how each phase runs on a target) and ``rtcompile build`` (the main
job: plan, tune where a GPU is present, plan again from the measurements, validate, write)."""

from __future__ import annotations

import json
import os
import sys

from .cli_args import (UsageError, check_cache_writable, check_out_file, check_out_not_input, check_storage, int_list,
                       nonempty, positive_int, tuning_buckets, write_out)


def _common(p, target_note: str = "") -> None:
    from .target import DEFAULT_TARGET, PROFILES

    p.add_argument("spec", help="model spec file (.toml or .json)")
    p.add_argument("--target", default=None, metavar="NAME", type=nonempty(", ".join(["auto", *PROFILES])),
                   help=f"GPU profile (auto, h100-sxm, h200, a100-80gb, l40s, l4, rtx-4090, b200); default: auto "
                        f"on a GPU, {DEFAULT_TARGET} without one{target_note}")
    p.add_argument("--batch", type=int_list, metavar="B,..", help="prefill batches to plan (default 1,8)")
    p.add_argument("--seq-len", type=int_list, metavar="T,..", help="prefill lengths to plan (default 16 to 65536)")
    p.add_argument("--decode-batch", type=int_list, metavar="B,..", help="decode batches (default 1,8,32,128,256)")
    p.add_argument("--out", metavar="FILE", type=nonempty("a file path"),
                   help="write the plan as JSON (atomically; its folder made when missing)")


def add_parsers(sub) -> None:
    p = sub.add_parser("plan", help="choose recurrent or chunk execution, chunk size and kernel config per phase")
    _common(p)
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=run_plan)
    b = sub.add_parser("build", help="main job: plan, tune (GPU), re-plan from measurements, validate kernels")
    # tuning measures the GPU present, so its measurements are no plan for another GPU
    _common(b, ". On a GPU, auto (or the profile of the GPU present) tunes this GPU at the requested "
               "--batch / --seq-len / --decode-batch and plans from the measurements; another GPU's profile is "
               "planned from its datasheet figures, without tuning")
    b.add_argument("--trials", type=positive_int, default=10, metavar="N",
                   help="tuning trials per kernel and bucket on a GPU (default 10)")
    b.add_argument("--storage", metavar="URL", type=nonempty("a storage URL"),
                   help="tuning store (see rtcompile tune); checked on a CPU too, where nothing is tuned")
    b.set_defaults(func=run_build)


def _on_gpu() -> bool:
    import torch

    return torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"


def _make(args, target_name: str):
    from .plan import DECODE_BATCHES, PREFILL_BATCHES, PREFILL_SEQ_LENS, make_plan
    from .spec import load_spec
    from .target import get_target

    spec = load_spec(args.spec)
    target = get_target(target_name)
    plan = make_plan(spec, target, batches=tuple(args.batch or PREFILL_BATCHES),
                     seq_lens=tuple(args.seq_len or PREFILL_SEQ_LENS),
                     decode_batches=tuple(args.decode_batch or DECODE_BATCHES))
    return spec, target, plan


def _target_name(args) -> str:
    from .target import DEFAULT_TARGET

    if args.target is not None:
        return args.target
    return "auto" if _on_gpu() else DEFAULT_TARGET


def _config_text(v: dict) -> str:
    """A config dict in a table cell: its form and tiles (block_k only where the form has one)."""
    bk = f" BK{v['block_k']}" if "block_k" in v else ""
    return f"{v.get('form')}{bk} BV{v.get('block_v')} w{v.get('num_warps')}"


def _print(plan, spec, target) -> None:
    from rich.console import Console
    from rich.table import Table

    ms = lambda s: f"{s * 1e3:.4g}"
    t = Table(title=f"plan: {spec.name or 'spec'} on {target.name} ({'measured' if target.measured else 'profile'} rates)",
              header_style="bold")
    for c in ("phase", "B", "T", "mode", "C", "variant", "state", "ms/layer", "bound", "source", "alternatives (ms)"):
        t.add_column(c)
    for d in plan.decisions:
        vt = _config_text(d.variant)
        short = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
        alts = ", ".join(f"{a['mode']}{' ' + a['variant']['form'] if a['mode'] == 'chunk' else ''}"
                         f"{' ' + short[a['state_dtype']] if 'state_dtype' in a else ''} {ms(a['cost']['seconds'])}"
                         f"{' (not run)' if a.get('note') else ''}"  # listed for comparison only
                         for a in d.alternatives)
        t.add_row(d.phase, str(d.batch), str(d.seq_len), d.mode, str(d.chunk_size or "-"), vt, short[d.state_dtype],
                  ms(d.cost["seconds"]), d.cost["bound"], d.cost["source"], alts)
    con = Console(width=220, markup=False)  # a spec's name is text, never markup
    con.print(t)
    cross = ", ".join(f"{k}: {v if v is not None else 'never'}" for k, v in plan.crossover.items())
    con.print(f"chunk-parallel prefill is no slower than the recurrent scan from T = {cross} tokens")


def run_plan(args) -> int:
    if args.out is not None:
        check_out_file("rtcompile plan", args.out)  # tried, nothing made: a bad spec leaves no folder
        check_out_not_input("rtcompile plan", args.out, "the spec file", args.spec)
    spec, target, plan = _make(args, _target_name(args))
    if args.out is not None:
        write_out("rtcompile plan", args.out, lambda: plan.save(args.out))
    if args.json:
        print(json.dumps(plan.to_dict(), indent=1))
    else:
        _print(plan, spec, target)
        if args.out:
            print(f"plan written to {args.out}")
    return 0


def _validate_kernels(spec) -> list[tuple[str, float, bool]]:
    """Run every kernel at a small shape of the spec's order (interpreter off the GPU) against
    the float64 reference; returns (kernel, relative error, passed)."""
    import torch

    from .kernels.reference import running_tensor_recurrent_ref
    from .kernels.launch import running_tensor_decode_, running_tensor_fwd

    dev = "cuda" if _on_gpu() else "cpu"
    widths = tuple(min(w, 4) for w in spec.key_widths)
    V, H, T = min(spec.value_width, 8), 1, 40
    gen = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    q, k, v = [r(2, T, H, w) for w in widths], [r(2, T, H, w) for w in widths], r(2, T, H, V)
    g = torch.nn.functional.logsigmoid(r(2, T, H)) if spec.features.forget_gate else None
    beta = torch.sigmoid(r(2, T, H)) if spec.features.delta_rule else None
    f32 = lambda x: None if x is None else x.float().to(dev)
    l2 = spec.features.l2norm
    o_ref, s_ref = running_tensor_recurrent_ref(q, k, v, g, beta, output_final_state=True, l2norm=l2)
    err = lambda a, b: float((a.double().cpu() - b).norm() / b.norm())
    out = []
    for name, kw in (("chunk", dict(mode="chunk")), ("recurrent", dict(mode="recurrent"))):  # their defaults
        o, s = running_tensor_fwd([f32(x) for x in q], [f32(x) for x in k], f32(v), f32(g), f32(beta),
                                  output_final_state=True, l2norm=l2, **kw)
        e = max(err(o, o_ref), err(s, s_ref))
        out.append((name, e, e < 1e-4))
    one = lambda x: None if x is None else x[:, :1]
    o1, s1 = running_tensor_recurrent_ref([one(x) for x in q], [one(x) for x in k], one(v), one(g), one(beta),
                                          output_final_state=True, l2norm=l2)
    cache = torch.zeros(3, H, *widths, V, device=dev)
    idx = torch.tensor([2, 0], dtype=torch.int32, device=dev)
    o = running_tensor_decode_([f32(one(x)) for x in q], [f32(one(x)) for x in k], f32(one(v)), f32(one(g)),
                               f32(one(beta)), state_cache=cache, state_indices=idx, l2norm=l2)
    e = max(err(o, o1), err(cache[[2, 0]], s1))
    out.append(("decode", e, e < 1e-4))
    return out


def _check_order(spec, path: str) -> None:
    """The Triton kernels' orders (build validates them, and tunes them on a GPU): another order
    is a usage error before any work, not a ValueError out of the kernel checks."""
    from .functional import MAX_TRITON_ORDER

    if spec.order > MAX_TRITON_ORDER:
        raise UsageError(f"rtcompile build: {path}: order {spec.order}; the Triton kernels that build validates "
                         f"(and tunes on a GPU) take orders 2-{MAX_TRITON_ORDER}; allowed: a spec of order 2 to "
                         f"{MAX_TRITON_ORDER}")


def _tunes_here(target_name: str) -> bool:
    """Does a build on this GPU tune for ``target_name``: auto, or the profile of the GPU present
    (detect() names a known GPU by its profile). Another GPU's profile is planned without
    tuning: measurements of this GPU are no figures of that one."""
    from .target import detect

    return target_name.lower() == "auto" or detect().name == target_name.lower()


def run_build(args) -> int:
    from rich.console import Console

    on_gpu = _on_gpu()
    if not on_gpu:
        # first: triton picks its driver when a kernel module is imported, and check_storage's
        # store (the tuned table's package) imports them; a CPU has no driver but the interpreter
        os.environ["TRITON_INTERPRET"] = "1"
    out = args.out if args.out is not None else "plan.json"
    check_out_file("rtcompile build", out)  # before minutes of tuning and checks, not after; nothing made
    check_out_not_input("rtcompile build", out, "the spec file", args.spec)  # --out's default, plan.json, may be it
    from .spec import load_spec

    _check_order(load_spec(args.spec), args.spec)
    if args.storage is not None:
        check_storage(args.storage, create=True)  # as tune checks it, also where no tuning follows
    # The notices (no GPU: the cost model and the interpreter; on a GPU the measured rates and
    # the tuning progress) say how the plan is made: they are the start of the report the table
    # continues, so they go to stdout with it. stderr then holds a failure alone, as one line (a
    # late write failure, a failed kernel check), never after a notice that is not an error.
    report = Console(markup=False)
    target_name = _target_name(args)
    spec, target, plan = _make(args, target_name)
    if on_gpu and _tunes_here(target_name):
        check_cache_writable("rtcompile build")  # the tuned table is written after the trials: tried before them
        from .target import measure
        from .tuning import TuneOptions, refusal, tune_bucket
        from .tuning.processes import stop_on_signal

        # the buckets `rtcompile tune` would tune at these options (its GPU defaults where none given)
        buckets = tuning_buckets(spec, "all", args.batch, args.seq_len, args.decode_batch, on_gpu=True)
        for bucket in buckets:
            if (reason := refusal(bucket)) is not None:
                raise UsageError(f"rtcompile build: {reason}")
        target = measure()
        report.print(f"measured {target.name}: copy {target.hbm_bytes_per_s / 1e9:.0f} GB/s, "
                     f"bf16 matmul {target.bf16_flops / 1e12:.0f} TFLOP/s")
        opts = TuneOptions(storage=args.storage, trials=args.trials, device="cuda", repeats=20)
        # as `rtcompile tune`: a SIGTERM stops the workers and trial processes too (Python's
        # default ended the build at once and its workers tuned on to their deadline)
        with stop_on_signal():
            for bucket in buckets:
                res = tune_bucket(bucket, opts)
                report.print(f"tuned {bucket.label}: {'already tuned' if res.already_tuned else f'{res.trials_run} trials'}")
        spec, target, plan = _make(args, "auto")  # the measured target of this GPU, the table's new winners
    elif on_gpu:
        report.print(f"--target {target_name} is not this GPU: planning for {target.name} from its profile "
                     "(no tuning: this GPU's measurements are not that one's; --target auto tunes this GPU); "
                     "validating the kernels on this GPU")
    else:
        report.print(f"no CUDA GPU: planning for {target.name} with the cost model (no tuning); validating the kernels "
                     "through the Triton interpreter at small shapes")
    checks = _validate_kernels(spec)
    _print(plan, spec, target)
    for name, e, ok in checks:
        print(f"kernel check {name}: relative error {e:.1e} against float64 -> {'ok' if ok else 'FAILED'}")
    if not all(ok for _, _, ok in checks):
        print("kernel validation failed: no plan written", file=sys.stderr)
        return 1
    write_out("rtcompile build", out, lambda: plan.save(out))
    print(f"plan written to {out}")
    return 0
