"""The decode and fused layer-step kernels with this checkout's ``recurrent.token_update`` beside
the same kernels with the previous one, in one process (GPU only).

The previous update took the slab's two products over the keys one after the other (S^T k, the
update, then S'^T q), so the new slab's store waited on two cross-warp reductions; the current
one takes both from the slab as loaded (o = scale (a S^T q + (k . q) u)). Here the kernels are
rebuilt with the previous helper (same source otherwise, their own compiled kernels) and swapped
in while a row is measured, alternating with the current ones over ``--rounds``:

- the decode kernel through ``rtcompile bench``'s decode measure (the public op, slot groups
  rotated past the L2, graph replay, the float64 check of one step), beside a same-size copy;
- the example model's compiled decode step with the fused layer kernel (``compile_step``),
  through ``bench --model``'s decode measure.

    python benchmarks/compare_token_update.py [--rounds 2] [--model-batches 32 256] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import types
from pathlib import Path

import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@triton.jit
def previous_token_update(b_s, b_k, b_q, b_v, b_a, b_beta, scale, DELTA: tl.constexpr):
    # recurrent.token_update as it was at 17405f4
    b_s = b_s * b_a
    if DELTA:
        b_u = b_beta * (b_v - tl.sum(b_s * b_k[:, None], axis=0))
    else:
        b_u = b_v
    b_s += b_k[:, None] * b_u[None, :]
    b_o = tl.sum(b_s * b_q[:, None], axis=0) * scale
    return b_s, b_o


def rebound(kernel, **names):
    """``kernel`` (a Triton JIT function) compiled with some global names bound to others."""
    fn = kernel.fn
    scope = dict(fn.__globals__, **names)
    copy = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__module__, copy.__qualname__ = fn.__module__, fn.__qualname__
    copy.__annotations__, copy.__kwdefaults__ = dict(fn.__annotations__), fn.__kwdefaults__  # the constexprs
    return triton.jit(copy)


def previous_kernels() -> dict:
    from rtcompile.kernels import decode_plan, layer_step, recurrent

    resident = rebound(recurrent._resident_tokens, token_update=previous_token_update)
    decode = rebound(recurrent.fused_recurrent_running_tensor_fwd_kernel, _resident_tokens=resident)
    return {
        (recurrent, "fused_recurrent_running_tensor_fwd_kernel"): decode,
        (decode_plan, "fused_recurrent_running_tensor_fwd_kernel"): decode,  # the eager decode call's plans
        (layer_step, "fused_layer_decode_step_kernel"):
            rebound(layer_step.fused_layer_decode_step_kernel, token_update=previous_token_update),
    }


@contextlib.contextmanager
def swapped(kernels: dict | None):
    """The launchers' module globals pointed at ``kernels`` (None: as they are) for the block;
    the decode calls' remembered plans (which hold compiled launchers) forgotten either side."""
    from rtcompile.kernels.decode_plan import DECODE_PLANS

    saved = {key: getattr(*key) for key in kernels or {}}
    DECODE_PLANS.clear()
    try:
        for (module, name), kernel in (kernels or {}).items():
            setattr(module, name, kernel)
        yield
    finally:
        for (module, name), kernel in saved.items():
            setattr(module, name, kernel)
        DECODE_PLANS.clear()


def main() -> None:
    import torch

    from rtcompile.bench.core import IMPL_COPY, IMPL_RT, BenchContext, Case
    from rtcompile.bench.lm import IMPL_RT_LAYERS, build_model, measure_model_decode
    from rtcompile.bench.measure import measure_decode
    from rtcompile.spec import load_spec

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--model-batches", type=int, nargs="*", default=[32, 256])
    ap.add_argument("--spec", default="examples/order3_16x16.toml")
    ap.add_argument("--out")
    a = ap.parse_args()
    device = torch.device("cuda")
    ctx = BenchContext(device, 10, l2_bytes=torch.cuda.get_device_properties(0).L2_cache_size)
    variants = {"current": None, "previous": previous_kernels()}
    decode = [Case(f"decode {w} B{b}", "decode", w, b, 1, H=8, V=64) for w, b in
              (((16, 16), 32), ((16, 16), 256), ((32, 32), 32), ((32, 32), 128))]
    spec = load_spec(args_spec := a.spec)
    lm = build_model(spec, device)
    rows = []
    for r in range(a.rounds):
        for case in decode:
            copy = measure_decode(case, IMPL_COPY, ctx).seconds
            for name, kernels in variants.items():
                with swapped(kernels):
                    out = measure_decode(case, IMPL_RT, ctx)
                rows.append(dict(round=r, what=case.name, variant=name, us=out.seconds * 1e6, copy_us=copy * 1e6,
                                 fraction=copy / out.seconds, rel_rms_out=out.rel_rms_err, note=out.note))
                print(json.dumps(rows[-1]), flush=True)
        for b in a.model_batches:
            case = Case(f"model decode B{b}", "decode", tuple(spec.key_widths), b, 1)
            for name, kernels in variants.items():
                with swapped(kernels), torch.no_grad():
                    out = measure_model_decode(lm, case, IMPL_RT_LAYERS, ctx)
                rows.append(dict(round=r, what=case.name, variant=name, us=out.seconds * 1e6,
                                 tokens_per_s=b / out.seconds, note=out.note))
                print(json.dumps(rows[-1]), flush=True)
    print(f"\n{torch.cuda.get_device_name()}  spec {args_spec}")
    for what in dict.fromkeys(row["what"] for row in rows):
        line = [what]
        for name in variants:
            us = [row["us"] for row in rows if row["what"] == what and row["variant"] == name]
            frac = [row.get("fraction") for row in rows if row["what"] == what and row["variant"] == name]
            line.append(f"{name} {statistics.median(us):8.1f} us" + (f" ({statistics.median(frac):.3f})" if frac[0] else ""))
        print("  ".join(line))
    if a.out:
        Path(a.out).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), rows=rows), indent=1))


if __name__ == "__main__":
    main()
