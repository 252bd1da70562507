"""Probe, no GPU needed: compile the chunk kernels of one prefill call for an H100/H200 (sm_90)
with Triton's bundled ptxas and report, per kernel, registers, spill stack, shared memory and
the sequential loop's SASS instruction mix.

The device's timings stay the measure; this answers "does the kernel spill, how long is its
loop" without a GPU, e.g. to compare SASS before and after a change. Use the device's Triton
for its numbers (3.6 and 3.9 compile the K = 256 state loop to 914 and 1024 instructions):
install that wheel into a folder of its own and put it first, e.g.
``pip install --no-deps --target /tmp/t36 triton==3.6.0`` then ``PYTHONPATH=/tmp/t36``.

    python3 benchmarks/probe_offline.py                                     (the K = 256 default)
    python3 benchmarks/probe_offline.py --widths 32 32 --set num_stages=2 --set block_v=16
    python3 benchmarks/probe_offline.py --backward --set grads_warps=4   (the backward's kernels)
    python3 benchmarks/probe_offline.py --widths 32 32 --config '{"form": "split", "chunk_size": 32, "block_v": 16}'
                                              (a config outside its form's space: the split form's
                                               Triton loop at K 1024 spills in every variant tried)
    python3 benchmarks/probe_offline.py --decode 32 --set block_v=64 --set num_warps=8
                                              (the decode step's kernel at B32 with B256's default
                                               tile; its registers bound its occupancy)

Nothing is launched: the launcher runs on CPU tensors with the kernels' launch intercepted, so
the device and shared-memory checks are bypassed here (the compiler's answer is the point).
Each launch is specialised by Triton's own binder, as on the GPU (CPU tensors are allocated
64-byte aligned, as CUDA ones are 256-byte aligned): "aligned args" counts the arguments that
carry that specialisation. ``PROBE_TOP=N`` in the environment lists the loop's N most frequent
instructions (default 8); ``PROBE_DUMP=DIR`` writes each kernel's TTGIR, PTX and SASS there.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime.jit import JITFunction

from rtcompile.kernels import chunk_split, launch, recurrent
from rtcompile.kernels import chunk_backward
from rtcompile.kernels.chunk_backward import default_backward
from rtcompile.kernels.config import KernelShape
from rtcompile.kernels.forms import config_from_dict, default_config

H200_SMEM = 232448  # shared_memory_per_block_optin of the H200 (the default's choice depends on it)


def _compile(fn: JITFunction, args: tuple, kwargs: dict):
    """Compile one intercepted launch for sm_90 the way a launch on the GPU would: Triton's own
    binder specialises the arguments, so pointers 16-byte aligned and integers divisible by 16
    carry ``tt.divisibility`` and integers equal to 1 become constants. Without those the
    compiler cannot prove a vector access aligned: a hand-built signature made the prepare
    kernel's phi(K) store 64 two-byte stores a thread per block (9896 instructions, 536 B of
    spills) where the launch's alignment gives 8 of 16 bytes (5872, no spills)."""
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", 90, 32)
    backend = CUDABackend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    source = triton.compiler.ASTSource
    if getattr(fn, "is_gluon", lambda: False)():  # a Gluon kernel's module carries its warp count
        from triton.experimental.gluon._runtime import GluonASTSource as source
    src = source(fn, signature, constexprs, attrs)
    return triton.compile(src, target=target, options=options.__dict__)


def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def _usage(cubin: bytes) -> dict[str, int]:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", f.name], capture_output=True,
                             text=True, check=True).stdout
        sass = subprocess.run([_tool("cuobjdump"), "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
    fields = dict(re.findall(r"(REG|STACK|SHARED):(\d+)", out))
    return {"regs": int(fields["REG"]), "stack": int(fields["STACK"]), "sass": sass}


def _instructions(sass: str) -> list[tuple[int, str, str]]:
    """(address, opcode, text without its predicate) of every SASS instruction."""
    ins = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            body = re.sub(r"^@!?U?P[T0-9]+\s+", "", m.group(2).strip())
            ins.append((int(m.group(1), 16), body.split()[0], body))
    return ins


def loop_mix(sass: str) -> tuple[int, collections.Counter]:
    """Length and opcode mix of the longest backward branch's body (the sequential loop)."""
    ins = _instructions(sass)
    spans = [(int(t.group(1), 16), addr) for addr, op, body in ins if op.startswith("BRA")
             for t in [re.search(r"0x([0-9a-f]+)", body)] if t and int(t.group(1), 16) < addr]
    if not spans:
        return 0, collections.Counter()
    lo, hi = max(spans, key=lambda s: s[1] - s[0])
    ops = [op.split(".")[0] for addr, op, _ in ins if lo <= addr <= hi]
    return len(ops), collections.Counter(ops)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--widths", type=int, nargs="+", default=[16, 16])
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="change a field of the default chunk (or backward) config (JSON value)")
    ap.add_argument("--backward", action="store_true", help="the backward's launches (its default config)")
    ap.add_argument("--decode", type=int, metavar="B", help="the decode step's launch at batch B (its default config)")
    ap.add_argument("--config", metavar="JSON", help="a whole chunk config instead of the default (to_dict's form, e.g. "
                    "'{\"form\": \"split\", \"chunk_size\": 32, \"block_v\": 16}'); --set changes it further")
    args = ap.parse_args(argv)
    if args.decode is not None and (args.decode < 1 or args.backward):
        print("probe_offline: --decode: a batch >= 1, without --backward", file=sys.stderr)
        return 2
    if not isinstance(chunk_split.chunk_split_state_kernel, JITFunction):
        print("probe_offline: the kernels were built for the interpreter: unset TRITON_INTERPRET", file=sys.stderr)
        return 2
    shape = KernelShape(tuple(args.widths), 64)
    changes = {}
    for item in args.set:
        name, _, value = item.partition("=")
        try:
            changes[name] = json.loads(value)
        except json.JSONDecodeError:
            changes[name] = value
    try:
        if args.backward:
            base = default_backward(KernelShape(shape.key_widths, 64, 2), H200_SMEM)
        elif args.config is not None:  # any form, also outside its space (what would this compile to?)
            base = config_from_dict(json.loads(args.config), "recurrent" if args.decode else "chunk")
        else:
            # the decode step's default depends on its batch (H8 here), as the launcher's does
            base = default_config("recurrent" if args.decode else "chunk", shape, H200_SMEM,
                                  decode_rows=args.decode * 8 if args.decode else None)
        # through from_dict: a value of the wrong type (--set tma=False is the string "False",
        # which replace() took as a true flag) is refused, naming the field
        variant = type(base).from_dict({**base.to_dict(), **changes})
    except (TypeError, ValueError) as exc:  # json's JSONDecodeError is a ValueError
        print(f"probe_offline: --set / --config: {exc}", file=sys.stderr)
        return 2
    B, T, H = (args.decode, 1, 8) if args.decode else (1, 256, 8)
    q = [torch.randn(B, T, H, w, dtype=torch.bfloat16) for w in args.widths]
    k = [torch.randn(B, T, H, w, dtype=torch.bfloat16) for w in args.widths]
    v = torch.randn(B, T, H, 64, dtype=torch.bfloat16)
    g, beta = -torch.rand(B, T, H), torch.rand(B, T, H)
    launches = []
    saved = JITFunction.run
    JITFunction.run = lambda self, *a, grid, warmup, **kw: launches.append((self, a, kw))
    try:  # CPU tensors, nothing launched: straight to the form's launcher, past the device checks
        p = launch.check_inputs(q, k, v, g, beta, None, None, None)
        ht = torch.empty(p.state_shape, dtype=torch.float32)
        if args.backward:
            # past running_tensor_bwd's device check, as the forward goes past launch's
            chunk_backward.launch_backward(variant, p, q, k, v, g, beta, None, None, True, torch.randn_like(v), ht)
        elif args.decode:  # a state cache of B slots updated in place, as running_tensor_decode_ launches it
            cache = torch.randn(B, H, *args.widths, 64)
            recurrent.launch(variant, p, q, k, v, g, beta, h0=cache, ht=cache, cu_seqlens=None, l2norm=True,
                             state_indices=torch.arange(B, dtype=torch.int32))
        else:
            launch.LAUNCHERS[type(variant)](variant, p, q, k, v, g, beta, h0=None, ht=ht, cu_seqlens=None,
                                            l2norm=True)
    finally:
        JITFunction.run = saved
    print(f"Triton {triton.__version__}, sm_90, widths {args.widths}, {variant}")
    for fn, a, kw in launches:
        ck = _compile(fn, a, kw)
        use = _usage(ck.asm["cubin"])
        n, mix = loop_mix(use["sass"])
        top = " ".join(f"{op}:{c}" for op, c in mix.most_common(int(os.environ.get("PROBE_TOP", 8))))
        spill_ops = sum(1 for _, op, _ in _instructions(use["sass"]) if op.startswith(("LDL", "STL")))
        aligned = ck.asm.get("ttir", ck.asm.get("ttgir", "")).count("tt.divisibility = 16")  # Gluon starts at ttgir
        if dump := os.environ.get("PROBE_DUMP"):  # each kernel's TTGIR, PTX and SASS, to read the loop's layouts
            os.makedirs(dump, exist_ok=True)
            for ext, text in (("ttgir", ck.asm.get("ttgir", "")), ("ptx", ck.asm.get("ptx", "")), ("sass", use["sass"])):
                with open(os.path.join(dump, f"{fn.__name__}.{ext}"), "w") as f:
                    f.write(text)
        print(f"{fn.__name__:40} regs {use['regs']:3}  spill stack {use['stack']:5} B  shared {ck.metadata.shared:6} B"
              f"  aligned args {aligned:2}  total {len(_instructions(use['sass'])):5} (spill ld/st {spill_ops})  loop {n:5}"
              f" instructions (spill ld/st {mix['LDL'] + mix['STL']})  {top}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
