"""Time each K <= 256 prefill default against the first Triton-loop proposal and fla, in one process.

    python benchmarks/compare_loops.py [--rounds 2]

On an sm_90 GPU the defaults of o2 64 / 128 / 256 and of materialised o3 8x8 / 16x8 run the split
form's state loop in Gluon (``SplitConfig.loop = "gluon"``); "previous" is the first proposal of
the defaults table with the Triton loop, given explicitly (elsewhere both columns are the same
config). Method as ``compare_defaults.py``: B8 T4096 H8 d_v 64 bf16, gate + delta rule + l2norm +
final state, each call captured in a CUDA graph per input set (two sets, replayed alternately),
median of 7 x 20 replays; fla's ``chunk_gated_delta_rule`` on materialised Kronecker keys. The
last column: the largest difference between the two configs' outputs over the largest output.
Prints a table last.
"""

from __future__ import annotations

import argparse

CASES = [("o2 64", (64,)), ("o2 128", (128,)), ("o2 256", (256,)), ("o3 8x8", (8, 8)), ("o3 16x8", (16, 8)),
         ("o3 16x16", (16, 16))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    from compare_defaults import untuned

    untuned()  # the defaults table's configs, whatever a tuner step wrote before
    import torch
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    import rtcompile
    from compare_defaults import _capture, _kron, _prefill_inputs, _timed
    from rtcompile.kernels import launch
    from rtcompile.kernels.forms import candidates
    from rtcompile.kernels.inputs import check_inputs

    dev = torch.device("cuda")
    rows = []
    for rnd in range(args.rounds):
        for name, widths in CASES:
            sets = [_prefill_inputs(widths, seed) for seed in (1, 2)]
            p = check_inputs(*sets[0], None, None, None)
            new = launch.resolve_config("chunk", None, p, dev)
            old = next(c for c in candidates("chunk", launch.kernel_shape(p), launch.smem_limit(dev))
                       if getattr(c, "loop", "triton") == "triton")

            def ours(s, cfg=None):
                return lambda: rtcompile.running_tensor(*s, l2norm=True, output_final_state=True, mode="chunk",
                                                        backend="triton", variant=cfg)

            def theirs(s):
                q, k, v, g, beta = s
                return lambda: chunk_gated_delta_rule(q, k, v, g.float(), beta, use_qk_l2norm_in_kernel=True,
                                                      output_final_state=True)
            o_new, _ = ours(sets[0])()
            o_old, _ = ours(sets[0], old)()
            diff = float((o_new.float() - o_old.float()).abs().max() / o_old.float().abs().max())
            t_new = _timed([_capture(ours(s)) for s in sets])
            t_old = _timed([_capture(ours(s, old)) for s in sets])
            kron = [(_kron(q), _kron(k), v, g, beta) for q, k, v, g, beta in sets]
            t_fla = _timed([_capture(theirs(s)) for s in kron])
            rows.append((rnd, name, getattr(new, "loop", type(new).__name__), t_new, t_old, t_fla, diff))
            print(rows[-1], flush=True)
            del sets, kron
            torch.cuda.empty_cache()
    print("\n| round | case | default's loop | default ms | previous ms | fla ms | fla / default | output diff |")
    print("|---|---|---|---|---|---|---|---|")
    for rnd, name, loop, t_new, t_old, t_fla, diff in rows:
        print(f"| {rnd} | {name} | {loop} | {t_new * 1e3:.4f} | {t_old * 1e3:.4f} | {t_fla * 1e3:.4f} | "
              f"{t_fla / t_new:.3f} | {diff:.1e} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
