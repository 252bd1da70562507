"""How each implementation is timed and checked on the device: timing (CUDA events, graphs,
L2 rotation), inputs, kernel entry points, the prefill/error/decode/eager measures, ceilings."""

from __future__ import annotations

import math
import time
import zlib
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Sequence

from .core import (
    COPY_BYTES,
    EAGER_CALLS,
    EAGER_TRIALS,
    EAGER_WARMUP,
    FLA_MAX_K,
    GRAPH_BELOW_S,
    IMPL_COPY,
    IMPL_FLA,
    IMPL_REF,
    IMPL_RT,
    IMPL_RT_RECURRENT,
    MATMUL_N,
    TOLERANCE,
    WARMUP_PASSES,
    BenchContext,
    Case,
    Ceilings,
    Measure,
    Outcome,
    Row,
    Work,
    clip_note,
    failure_note,
    graph_calls_count,
    median,
    repeats_for,
    rotation_count,
)

if TYPE_CHECKING:
    import torch

# ----- timing (torch imported lazily) ------------------------------------------------------------
@dataclass(frozen=True)
class Timing:
    seconds: float  # per call
    method: str


def _sync(ctx: BenchContext) -> None:
    if ctx.is_cuda:
        import torch

        torch.cuda.synchronize()


def warm_up(calls: Sequence[Callable[[], Any]], ctx: BenchContext, passes: int = WARMUP_PASSES) -> None:
    """Run every call ``passes`` times (the first compiles and autotunes); never timed."""
    for _ in range(passes):
        for c in calls:
            c()
    _sync(ctx)


def _per_call_times(calls: Sequence[Callable[[], Any]], ctx: BenchContext, n: int) -> list[float]:
    """Seconds of each of ``n`` eager calls (cycling ``calls``): CUDA events, or wall on CPU."""
    if not ctx.is_cuda:
        out = []
        for i in range(n):
            t0 = time.perf_counter()
            calls[i % len(calls)]()
            out.append(time.perf_counter() - t0)
        return out
    import torch

    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for i, (start, end) in enumerate(events):
        start.record()
        calls[i % len(calls)]()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) / 1e3 for start, end in events]


def _graph_timing(calls: Sequence[Callable[[], Any]], est_s: float, ctx: BenchContext) -> Timing:
    """Capture ``graph_calls_count`` calls in one CUDA graph; median replay / calls per graph."""
    from ..timing import graph_replay_seconds

    n = graph_calls_count(est_s, len(calls))
    per_call = graph_replay_seconds(calls, n, ctx.repeats)
    return Timing(per_call, f"graph x{n} calls ({len(calls)} sets), median of {ctx.repeats} replays")


def time_calls(calls: Sequence[Callable[[], Any]], ctx: BenchContext, *, graph: bool = True) -> Timing:
    """Median seconds per call of ``calls`` (cycled), already warmed up by the caller.

    Graph replay for calls under GRAPH_BELOW_S on CUDA; if capture fails (a host sync in the
    call, say), eager events, with the reason in the method text.
    """
    est = median(_per_call_times(calls, ctx, max(3, len(calls))))
    fallback = ""
    if graph and ctx.is_cuda and est < GRAPH_BELOW_S:
        try:
            return _graph_timing(calls, est, ctx)
        except Exception as exc:  # noqa: BLE001 -- fall back to eager timing, say why
            _sync_quietly()
            fallback = f"; graph capture failed ({clip_note(failure_note(exc))[:80]})"
    n = repeats_for(est, ctx.repeats)
    times = _per_call_times(calls, ctx, n)
    kind = "events" if ctx.is_cuda else "wall"
    return Timing(median(times), f"eager {kind}, {len(calls)} sets, median of {n}{fallback}")


def _sync_quietly() -> None:
    try:
        import torch

        torch.cuda.synchronize()
    except Exception:  # noqa: BLE001 -- best effort after a failed capture
        pass


def wall_per_call(call: Callable[[], Any], ctx: BenchContext, n: int | None = None,
                  trials: int | None = None) -> float:
    """Eager seconds per call: wall time of ``n`` back-to-back calls + one sync, median of trials.

    Nothing is subtracted: at a small shape this is the Python and launch cost a serving loop pays.
    """
    n, trials = n or EAGER_CALLS, trials or EAGER_TRIALS
    for _ in range(EAGER_WARMUP):
        call()
    _sync(ctx)
    out = []
    for _ in range(trials):
        _sync(ctx)
        t0 = time.perf_counter()
        for _ in range(n):
            call()
        _sync(ctx)
        out.append((time.perf_counter() - t0) / n)
    return median(out)


def _tensor_bytes(obj: Any) -> int:
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.untyped_storage().nbytes()
    if isinstance(obj, (tuple, list)):
        return sum(_tensor_bytes(x) for x in obj)
    return 0


def peak_extra_bytes(call: Callable[[], Any], ctx: BenchContext) -> int | None:
    """Peak memory of one call beyond what was allocated before and what it returns (CUDA only)."""
    if not ctx.is_cuda:
        return None
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = call()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    kept = _tensor_bytes(out)
    del out
    return int(peak - before - kept)


def rel_rms(actual: "torch.Tensor", expected: "torch.Tensor") -> float:
    """||actual - expected||_rms / ||expected||_rms in float64; inf if actual is not finite."""
    a, e = actual.double(), expected.double().reshape(actual.shape)
    if not bool(a.isfinite().all()):
        return math.inf
    num = (a - e).pow(2).mean().sqrt()
    den = e.pow(2).mean().sqrt().clamp_min(1e-300)
    return float(num / den)


def _error_outcome(err_o: float, err_s: float | None, dtype: str) -> Outcome:
    """Error fields: output error in ``rel_rms_err``, final-state error and any flag in the note."""
    if not math.isfinite(err_o) or (err_s is not None and not math.isfinite(err_s)):
        return Outcome(note="NaN/Inf in output or final state")
    worst = max(err_o, err_s or 0.0)
    note = f"state err {err_s:.1e}" if err_s is not None else ""
    tol = TOLERANCE.get(dtype)
    if tol is not None and worst > tol:
        note += f"; above {tol:g} ({dtype}): check"
    return Outcome(rel_rms_err=err_o, note=note)


# ----- inputs ------------------------------------------------------------------------------------
@dataclass
class Inputs:
    """One call's inputs: factor lists q, k ``[B, T, H, d_i]``, v ``[B, T, H, V]``, g, beta ``[B, T, H]``."""

    q: list
    k: list
    v: Any
    g: Any
    beta: Any
    scale: float

    def tensors(self) -> list:
        return [*self.q, *self.k, self.v, self.g, self.beta]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


def make_inputs(case: Case, device: Any, seed: int) -> Inputs:
    """Fresh random inputs for ``case`` in ``case.dtype`` (``kernels.inputs.random_inputs``, drawn
    on the device: benchmark sizes); the same seed gives the same values."""
    from ..kernels.inputs import random_inputs

    *qkvgb, _ = random_inputs(case.B, case.T, case.H, case.key_widths, case.V, case.dtype, device, seed,
                              draw_on="device")
    return Inputs(*qkvgb, case.K ** -0.5)


def kronify(inp: Inputs) -> Inputs:
    """The same problem at order 2: q, k replaced by phi(q), phi(k) (built in fp32, then cast)."""
    from ..kernels.reference import kron_features

    dt = inp.v.dtype
    phi_q = kron_features([x.float() for x in inp.q]).to(dt)
    phi_k = kron_features([x.float() for x in inp.k]).to(dt)
    return Inputs([phi_q], [phi_k], inp.v, inp.g, inp.beta, inp.scale)


def to_double(inp: Inputs) -> Inputs:
    return Inputs([x.double() for x in inp.q], [x.double() for x in inp.k], inp.v.double(),
                  inp.g.double(), inp.beta.double(), inp.scale)


def reference64(inp: Inputs, initial_state: Any = None) -> tuple:
    """The oracle: float64 token loop on the (already quantised) inputs -> (o, final state)."""
    from ..kernels.reference import running_tensor_recurrent_ref

    i64 = to_double(inp)
    s0 = None if initial_state is None else initial_state.double()
    return running_tensor_recurrent_ref(i64.q, i64.k, i64.v, i64.g, i64.beta, scale=i64.scale,
                                        initial_state=s0, output_final_state=True, l2norm=True)


def input_seed(case: Case, i: int) -> int:
    """Seed of input set i of a case. It depends on the case name and i only, so every
    implementation (and both dtypes of an error case) gets the same underlying values; crc32,
    not hash(), because str hashes change between processes."""
    return (zlib.crc32(case.name.encode()) * 1009 + i) & 0x7FFFFFFF


# ----- kernel entry points (imported when first called) ----------------------------------------
def _rt_fwd() -> Callable:
    from ..kernels.launch import running_tensor_fwd

    return running_tensor_fwd


def _rt_decode() -> Callable:
    from ..kernels.launch import running_tensor_decode_

    return running_tensor_decode_


def fla_version() -> str | None:
    """Installed fla-core version, or None (no import of fla itself)."""
    from importlib import metadata

    for dist in ("fla-core", "flash-linear-attention"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def fla_ops() -> Any:
    """fla's gated-delta-rule ops module; ImportError when fla is not installed."""
    import importlib

    return importlib.import_module("fla.ops.gated_delta_rule")


def _variant_kwargs(case: Case, impl: str) -> dict[str, Any]:
    """Extra kwargs for ``rtcompile[name]`` (none for plain ``rtcompile``)."""
    if impl.startswith(f"{IMPL_RT}[") and impl.endswith("]"):
        spec = case.variants[impl[len(IMPL_RT) + 1 : -1]]
        return dict(spec(case) if callable(spec) else spec)
    return {}


def _prefill_call(impl: str, case: Case, inp: Inputs) -> Callable[[], Any]:
    """A zero-argument call of ``impl`` on ``inp`` returning (o, final_state)."""
    common = dict(scale=inp.scale, output_final_state=True, l2norm=True)
    if impl == IMPL_REF:
        from ..kernels.reference import running_tensor_chunk_ref

        return lambda: running_tensor_chunk_ref(inp.q, inp.k, inp.v, inp.g, inp.beta,
                                                chunk_size=case.chunk_size, **common)
    if impl == IMPL_FLA:
        op = fla_ops().chunk_gated_delta_rule
        return lambda: op(q=inp.q[0], k=inp.k[0], v=inp.v, g=inp.g, beta=inp.beta, scale=inp.scale,
                          initial_state=None, output_final_state=True, use_qk_l2norm_in_kernel=True)
    fwd = _rt_fwd()
    if impl == IMPL_RT_RECURRENT:
        return lambda: fwd(inp.q, inp.k, inp.v, inp.g, inp.beta, mode="recurrent", **common)
    # No chunk_size: the kernel's default variant (or the named one) picks its own, as a caller
    # would get; forcing 64 would also conflict with a variant of another chunk size.
    # case.chunk_size is the reference's chunk and the C of the floor's figures.
    extra = _variant_kwargs(case, impl)
    return lambda: fwd(inp.q, inp.k, inp.v, inp.g, inp.beta, mode="chunk", **common, **extra)


def fla_refusal(case: Case) -> str | None:
    """Why fla is not called on ``case`` (None: call it): not installed, or K above what its chunk
    kernel takes in every phase that runs it (all but decode, fused_recurrent's)."""
    if fla_version() is None:
        return "skipped: fla-core not installed (pip install -e '.[bench]')"
    if case.phase != "decode" and case.K > FLA_MAX_K:
        return (f"refused: K={case.K} > {FLA_MAX_K}, not called (fla-core 0.6.0's chunk_gated_delta_rule "
                "asserts 'current kernel does not support head dimension larger than 256')")
    return None


# ----- prefill and error measures ----------------------------------------------------------------
def _prefill_sets(case: Case, ctx: BenchContext, kron: bool) -> list[Inputs]:
    """Enough input sets that consecutive calls do not reuse L2 (same seeds for every impl)."""
    first = make_inputs(case, ctx.device, input_seed(case, 0))
    if kron:
        first = kronify(first)
    out_bytes = case.B * case.T * case.H * case.V * first.v.element_size() + case.B * case.state_bytes_per_seq
    n = rotation_count(first.nbytes() + out_bytes, ctx.l2_bytes)
    sets = [first]
    for i in range(1, n):
        s = make_inputs(case, ctx.device, input_seed(case, i))
        sets.append(kronify(s) if kron else s)
    return sets


def measure_prefill(case: Case, impl: str, ctx: BenchContext) -> Outcome:
    """Time one prefill implementation: warm-up, peak extra memory of one call, median timing."""
    if impl == IMPL_FLA and (why := fla_refusal(case)):
        return Outcome(note=why)
    sets = _prefill_sets(case, ctx, kron=impl == IMPL_FLA)
    calls = [_prefill_call(impl, case, s) for s in sets]
    warm_up(calls, ctx)
    peak = peak_extra_bytes(calls[0], ctx)
    t = time_calls(calls, ctx)
    return Outcome(seconds=t.seconds, timing=t.method, peak_extra_mem_bytes=peak)


class _Oracle:
    """The error case's inputs and float64 reference, computed once and shared by all impls."""

    def __init__(self, case: Case, ctx: BenchContext):
        self.case, self.ctx = case, ctx
        self._value: tuple | None = None

    def get(self) -> tuple:
        if self._value is None:
            inp = make_inputs(self.case, self.ctx.device, input_seed(self.case, 0))
            o_ref, s_ref = reference64(inp)
            self._value = (inp, o_ref, s_ref)
        return self._value


def measure_error(case: Case, impl: str, oracle: _Oracle) -> Outcome:
    """Relative RMS error of one implementation's output (and final state) vs the float64 loop."""
    if impl == IMPL_FLA and (why := fla_refusal(case)):
        return Outcome(note=why)
    inp, o_ref, s_ref = oracle.get()
    call = _prefill_call(impl, case, kronify(inp) if impl == IMPL_FLA else inp)
    o, s = call()
    return _error_outcome(rel_rms(o, o_ref), rel_rms(s, s_ref) if s is not None else None, case.dtype)


# ----- decode measures ---------------------------------------------------------------------------
@dataclass
class _DecodeSetup:
    """Rotation over ``n`` groups of B slots in one state cache [n*B, H, d_1.., V] (fp32)."""

    sets: list  # Inputs with T = 1, one per group
    cache: Any
    indices: list  # int32 [B] per group, a random permutation of all slots


def _decode_setup(case: Case, ctx: BenchContext) -> _DecodeSetup:
    import torch

    n = rotation_count(case.B * case.state_bytes_per_seq, ctx.l2_bytes, minimum=2)
    sets = [make_inputs(case, ctx.device, input_seed(case, i)) for i in range(n)]
    gen = torch.Generator(device=ctx.device).manual_seed(input_seed(case, 10_000))
    slots = n * case.B
    cache = torch.randn(slots, case.H, *case.key_widths, case.V, generator=gen, device=ctx.device,
                        dtype=torch.float32)
    perm = torch.randperm(slots, generator=torch.Generator().manual_seed(input_seed(case, 20_000)))
    indices = [perm[i * case.B : (i + 1) * case.B].to(device=ctx.device, dtype=torch.int32) for i in range(n)]
    return _DecodeSetup(sets, cache, indices)


def _decode_calls(impl: str, case: Case, st: _DecodeSetup, *, validate: bool = False) -> tuple[list, Any]:
    """One call per group for ``impl``, and ``state_of(i)``: the state that group i reads next."""
    if impl == IMPL_REF:
        from ..kernels.reference import running_tensor_recurrent_ref

        longs = [i.long() for i in st.indices]

        def ref_call(s: Inputs, idx: Any) -> Callable[[], Any]:
            def call() -> Any:
                S = st.cache.index_select(0, idx)
                o, S1 = running_tensor_recurrent_ref(s.q, s.k, s.v, s.g, s.beta, scale=s.scale, initial_state=S,
                                                     output_final_state=True, l2norm=True)
                st.cache.index_copy_(0, idx, S1)
                return o
            return call

        return [ref_call(s, i) for s, i in zip(st.sets, longs, strict=True)], lambda i: st.cache[longs[i]]
    if impl == IMPL_FLA:
        op = fla_ops().fused_recurrent_gated_delta_rule
        B, H, K, V = case.B, case.H, case.K, case.V
        states = [st.cache[i.long()].reshape(B, H, K, V).contiguous() for i in st.indices]
        st.cache = None  # fla keeps its own per-group states; free the shared cache
        phis = [kronify(s) for s in st.sets]

        def fla_call(p: Inputs, S: Any) -> Callable[[], Any]:
            return lambda: op(q=p.q[0], k=p.k[0], v=p.v, g=p.g, beta=p.beta, scale=p.scale, initial_state=S,
                              output_final_state=True, use_qk_l2norm_in_kernel=True)

        return ([fla_call(p, S) for p, S in zip(phis, states, strict=True)],
                lambda i: states[i].reshape(B, H, *case.key_widths, V))
    dec = _rt_decode()
    extra = _variant_kwargs(case, impl)

    def rt_call(s: Inputs, idx: Any) -> Callable[[], Any]:
        return lambda: dec(s.q, s.k, s.v, s.g, s.beta, state_cache=st.cache, state_indices=idx, scale=s.scale,
                           l2norm=True, validate=validate, **extra)

    return [rt_call(s, i) for s, i in zip(st.sets, st.indices, strict=True)], lambda i: st.cache[st.indices[i].long()]


def _decode_error(impl: str, case: Case, st: _DecodeSetup, call: Callable, state_of: Callable) -> Outcome:
    """Error of one decode step from the current state of group 0 vs the float64 token loop."""
    s0 = state_of(0).clone()
    out = call()
    o, s1 = (out[0], out[1]) if impl == IMPL_FLA else (out, state_of(0))
    o_ref, s_ref = reference64(st.sets[0], initial_state=s0)
    return _error_outcome(rel_rms(o, o_ref), rel_rms(s1, s_ref), case.dtype)


def measure_decode(case: Case, impl: str, ctx: BenchContext) -> Outcome:
    """Warm-up, one checked step (error), then graph-replay timing rotating over slot groups."""
    if impl == IMPL_FLA and (why := fla_refusal(case)):
        return Outcome(note=why)
    if impl == IMPL_COPY:
        return _measure_same_size_copy(case, ctx)
    st = _decode_setup(case, ctx)
    if impl.startswith(IMPL_RT):
        checked, state_of = _decode_calls(impl, case, st, validate=True)
        checked[0]()  # first call: compile/autotune with validation on, the API default
        _sync(ctx)
        calls, _ = _decode_calls(impl, case, st, validate=False)
    else:
        calls, state_of = _decode_calls(impl, case, st)
        checked = calls
    warm_up(calls, ctx)
    err = _decode_error(impl, case, st, checked[0], state_of)
    t = time_calls(calls, ctx)
    validate_text = ", validate=False" if impl.startswith(IMPL_RT) else ""
    return replace(err, seconds=t.seconds, timing=t.method + validate_text)


def _measure_same_size_copy(case: Case, ctx: BenchContext) -> Outcome:
    """A device copy of exactly the state bytes of one decode call, rotated over as many buffer
    pairs as the decode call rotates over slot groups, and timed the same way."""
    import torch

    nbytes = case.B * case.state_bytes_per_seq
    n = rotation_count(nbytes, ctx.l2_bytes, minimum=2)
    src = [torch.empty(nbytes, dtype=torch.uint8, device=ctx.device).fill_(1) for _ in range(n)]
    dst = [torch.empty_like(s) for s in src]
    calls = [lambda s=s, d=d: d.copy_(s) for s, d in zip(src, dst, strict=True)]
    warm_up(calls, ctx)
    t = time_calls(calls, ctx)
    return Outcome(seconds=t.seconds, timing=t.method, work=Work(0, 2 * nbytes, None))


def measure_eager(case: Case, impl: str, ctx: BenchContext) -> Outcome:
    """Wall time per eager decode call at a small shape: Python and launch overhead."""
    if impl == IMPL_FLA and (why := fla_refusal(case)):
        return Outcome(note=why)
    st = _decode_setup(replace(case, phase="decode"), BenchContext(ctx.device, l2_bytes=0))
    if impl.startswith(IMPL_RT):
        calls, _ = _decode_calls(IMPL_RT, case, st, validate=impl.endswith("validate=True"))
    else:
        calls, _ = _decode_calls(impl, case, st)
    per = wall_per_call(calls[0], ctx)
    return Outcome(seconds=per, timing=f"wall, {EAGER_CALLS} eager calls back to back, median of {EAGER_TRIALS}",
                   note=f"{per * 1e6:.1f} us/call")


def measures_for(case: Case, ctx: BenchContext) -> dict[str, Measure]:
    """impl name -> zero-argument measurement for ``case`` (inputs are built inside each)."""
    if case.phase == "error":
        oracle = _Oracle(case, ctx)
        return {impl: (lambda impl=impl: measure_error(case, impl, oracle)) for impl in case.impl_names()}
    if case.phase == "train":
        from .train import measure_train  # train imports this module

        return {impl: (lambda impl=impl: measure_train(case, impl, ctx)) for impl in case.impl_names()}
    fn = {"prefill": measure_prefill, "decode": measure_decode, "eager": measure_eager}[case.phase]
    return {impl: (lambda impl=impl: fn(case, impl, ctx)) for impl in case.impl_names()}


# ----- ceilings --------------------------------------------------------------------------------
CEILING_CASE = Case("ceiling", "ceiling", (), 0, 0, dtype="")
IMPL_BIG_COPY = "copy 2 GiB"
IMPL_MATMUL = f"matmul bf16 {MATMUL_N}^3"


def _measure_big_copy(ctx: BenchContext, nbytes: int = COPY_BYTES) -> Outcome:
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=ctx.device).fill_(1)
    dst = torch.empty_like(src)
    calls = [lambda: dst.copy_(src)]
    warm_up(calls, ctx)
    t = time_calls(calls, ctx, graph=False)  # ~1 ms per call and 2 GiB: no graph, no L2 concern
    return Outcome(seconds=t.seconds, timing=t.method, work=Work(0, 2 * nbytes, None))


def _measure_matmul(ctx: BenchContext, n: int = MATMUL_N) -> Outcome:
    import torch

    gen = torch.Generator(device=ctx.device).manual_seed(0)
    a = torch.randn(n, n, generator=gen, device=ctx.device, dtype=torch.bfloat16)
    b = torch.randn(n, n, generator=gen, device=ctx.device, dtype=torch.bfloat16)
    c = torch.empty_like(a)
    calls = [lambda: torch.matmul(a, b, out=c)]
    warm_up(calls, ctx, passes=5)  # let clocks ramp before timing
    t = time_calls(calls, ctx, graph=False)
    return Outcome(seconds=t.seconds, timing=t.method, work=Work(2 * n**3, 0, None))  # a rate, not bytes


def ceiling_measures(ctx: BenchContext) -> dict[str, Measure]:
    return {IMPL_BIG_COPY: lambda: _measure_big_copy(ctx), IMPL_MATMUL: lambda: _measure_matmul(ctx)}


def ceilings_from(rows: Sequence[Row]) -> Ceilings:
    by_impl = {r.impl: r for r in rows}
    copy, mm = by_impl.get(IMPL_BIG_COPY), by_impl.get(IMPL_MATMUL)
    return Ceilings(copy.gbps if copy else None, mm.tflops if mm else None)
