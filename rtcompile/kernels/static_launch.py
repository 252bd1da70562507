"""A compiled Triton kernel launched through torch's C++ launcher (the T = 1 calls' hot path).

Triton's launcher of a compiled kernel (``CompiledKernel[grid](*args)``: a Python wrapper, the
stream and launch-metadata lookups, then its generated C launcher) took 8.9-12.6 us a call on the
H200 machine (Triton 3.6, torch 2.11; two processes), of an eager decode step's 20-31 us; torch's
took 5.2 in the process where Triton's took 8.9. torch builds a lean
launcher for Triton cubins into its CUDA library (``torch._C._StaticCudaLauncher._launch_kernel``,
what inductor's statically launched kernels call): the runtime arguments as one tuple with a
type string, then ``cuLaunchKernel``. It is private to torch, so it is taken only where it exists
and the compiled kernel asks for nothing it does not do (scratch memory, clusters, cooperative or
programmatic-dependent launches, Triton launch hooks installed when the plan is made); otherwise
:func:`static_launcher` returns None and Triton's launcher serves.
"""

from __future__ import annotations

import torch

# Triton's scalar types -> the launcher's one-character codes (pointers are "O": an int address
# or None). 16-bit float scalars are absent on purpose: the launcher would pass fp32 bits.
_SCALAR_CODES = {"i1": "i", "i8": "b", "i16": "h", "i32": "i", "i64": "l", "u1": "I", "u8": "B", "u16": "H",
                 "u32": "I", "u64": "K", "fp32": "f", "f32": "f", "fp64": "d"}


class StaticLaunch:
    """Launches one compiled kernel with a fixed grid on the current stream of ``device``.
    Invariant: called with the values of the kernel's leading parameters in their order, as
    plain Python values (pointers as int addresses, None for an absent input), the same
    constexpr ones (None inputs, specialised integers) as when the kernel was compiled."""

    __slots__ = ("_launch", "device", "function", "grid", "keep", "scratch", "shared", "types", "warps")

    def __init__(self, launch, function: int, grid: tuple, warps: int, shared: int, types: str,
                 keep: tuple[int, ...], scratch: int, device: int):
        self._launch, self.function, self.grid, self.warps = launch, function, grid, warps
        self.shared, self.types, self.keep, self.device = shared, types, keep, device
        self.scratch = (None,) * scratch  # null scratch pointers after the declared parameters

    def __call__(self, values: tuple) -> None:
        self._launch(self.function, *self.grid, self.warps, self.shared, self.types,
                     tuple([values[i] for i in self.keep]) + self.scratch,
                     torch._C._cuda_getCurrentRawStream(self.device))


def _hooks_installed() -> bool:
    try:
        from triton import knobs
    except ImportError:  # an older Triton (class attributes of CompiledKernel)
        return True
    for hook in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):  # HookChain (newer Tritons): its calls
            return True
    return False


def static_launcher(compiled, grid: tuple, n_values: int, device: int) -> StaticLaunch | None:
    """torch's launcher for ``compiled`` (a Triton ``CompiledKernel`` whose handles are loaded)
    with ``grid``, taking the values of its first ``n_values`` parameters; None when torch has
    no such launcher or the kernel needs something it does not do (then Triton's launches it)."""
    launch = getattr(getattr(torch._C, "_StaticCudaLauncher", None), "_launch_kernel", None)
    src, md = getattr(compiled, "src", None), getattr(compiled, "metadata", None)
    function = getattr(compiled, "function", None)
    if launch is None or src is None or md is None or not isinstance(function, int) or _hooks_installed():
        return None
    if getattr(md, "num_ctas", 1) != 1 or getattr(md, "launch_cooperative_grid", False) \
            or getattr(md, "launch_pdl", False) or tuple(getattr(md, "cluster_dims", (1, 1, 1)) or (1, 1, 1)) != (1, 1, 1):
        return None
    names = list(getattr(getattr(src, "fn", None), "arg_names", []))
    signature = getattr(src, "signature", {})
    constants = getattr(src, "constants", {})
    if not names or set(signature) != set(names):
        return None
    codes, keep = [], []
    for i, name in enumerate(names):
        ty = signature[name]
        if ty == "constexpr" or (i,) in constants or name in constants:
            continue
        code = "O" if isinstance(ty, str) and ty.startswith("*") else _SCALAR_CODES.get(ty)
        if code is None or i >= n_values:
            return None
        codes.append(code)
        keep.append(i)
    # Tritons since 3.3 (global) and 3.5 (profile) give every kernel scratch-pointer parameters
    # after the declared ones: null where the kernel uses no scratch, which is all this supports
    scratch = 0
    for size in ("global_scratch_size", "profile_scratch_size"):
        if hasattr(md, size):
            if getattr(md, size):
                return None
            codes.append("O")
            scratch += 1
    grid3 = tuple((*grid, 1, 1)[:3])
    return StaticLaunch(launch, function, grid3, int(md.num_warps), int(md.shared), "".join(codes), tuple(keep),
                        scratch, device)
