"""``rtcompile bench --model SPEC``: the whole model, not one kernel.

:class:`RunningTensorLM` built from the spec (random weights, seeded, cast to the spec's input
dtype; the state in the spec's state dtype) is timed on one CUDA GPU:

* prefill: one forward over a random prompt [B, T] from a zero state (B1 and B8 at T 4096;
  T 1024 with ``quick``), timed as the kernel bench times a call (:func:`.measure.time_calls`:
  CUDA-graph replays of many calls when a call is short, else CUDA events; the row says which);
* decode: the decode step of all layers captured as one CUDA graph per batch bucket
  (:class:`rtcompile.generate.StaticStep`, what ``generate`` replays), steady-state step time
  at B1, B32 and B256 (B1, B32 with ``quick``); tokens/s = B / step time.

Each case runs ``rtcompile`` (our Triton kernels) and, where K = prod(key_widths) <= 256, ``fla``:
the same model and weights with its state mixer replaced (``RunningTensorLayer.forward``'s
``mixer``) by fla-core's gated delta rule on Kronecker keys materialised inside the forward.

This module imports torch and the model; the CLI imports it only for ``--model``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from ..generate import StaticStep, bucket_of
from ..model import Mixer, RunningTensorLM
from ..spec import ModelSpec
from .core import (
    DEFAULT_BUDGET_S,
    DEFAULT_REPEATS,
    FLA_MAX_K,
    GRAPH_BELOW_S,
    IMPL_FLA,
    IMPL_RT,
    PREFILL_T,
    QUICK_T,
    WARMUP_PASSES,
    BenchContext,
    BenchOptions,
    Case,
    Ceilings,
    Deadline,
    Outcome,
    Row,
    Work,
    check_run_options,
    run_one,
)
from .measure import (
    Inputs,
    fla_ops,
    fla_refusal,
    fla_version,
    input_seed,
    kronify,
    peak_extra_bytes,
    rel_rms,
    time_calls,
    warm_up,
)
from .report import collect_header, print_model_table, progress_line, write_results

PREFILL_BATCHES = (1, 8)  # at PREFILL_T (QUICK_T with --quick)
DECODE_BATCHES = (1, 32, 256)
QUICK_DECODE_BATCHES = (1, 32)
DECODE_PROMPT_T = 16  # the prompt prefilled before decoding (its cache is what the graph starts from)
VOCAB = 256  # rtcompile export's default vocabulary: the example bundle's of issue 21's numbers
SEED = 0
RT_BACKEND = "triton"  # ours, never a silent fall back to the reference
IMPL_RT_FUSED = "rtcompile+stacked"  # decode: each layer's input maps as one product (StaticStep(fuse_projections))
IMPL_RT_COMPILED = "rtcompile+compile"  # decode: maps stacked, then the step fused by torch.compile before capture
IMPL_RT_LAYERS = "rtcompile+layers"  # decode: compiled, each eligible layer's step one kernel (StaticStep(fuse_layers))

MODEL_METHOD = (
    "Model: RunningTensorLM(spec, vocab {vocab}, MLP on), weights initialised after "
    "torch.manual_seed({seed}) and cast to the spec's input dtype; the state in the spec's state dtype "
    "(fp32 for 'auto'); torch.no_grad; no plan (the kernels' tuned or default configs). rtcompile: "
    "backend='{backend}' (our chunk kernels for prefill; running_tensor_decode_ updating the cache in place "
    "for decode). fla (only where K = prod(key_widths) <= {fla_k}): the same model and weights with the state "
    "mixer of every layer replaced (RunningTensorLayer.forward's mixer) by fla-core's chunk_gated_delta_rule "
    "(T > 1) or fused_recurrent_gated_delta_rule (T = 1) on Kronecker keys phi(q), phi(k) built inside the "
    "forward (fp32 outer products cast to the input dtype: timed, as a model using fla on this problem pays "
    "them), use_qk_l2norm_in_kernel = the spec's l2norm; fla returns its final state as a new tensor, copied "
    "into the cache. Prefill: one forward over a random prompt [B, T] from a zero state (logits and every "
    "layer's cache), {warmup} warm-up calls (compile, autotune) never timed, then timed as rtcompile bench "
    "times kernels: calls under {graph_ms:g} ms by an eager estimate are captured in one CUDA graph of many "
    "calls and the median replay time over --repeats replays is divided by the calls per graph; longer calls "
    "are timed with CUDA events around each eager call, median of --repeats; the timing column says which. "
    "No L2 rotation (the inputs are token ids; the weights staying in L2 is what a server sees). "
    "tokens/s = B*T / time. mem+ = peak allocated during one forward - allocated before - the returned logits. "
    "err (fla prefill rows): relative RMS of fla's logits against rtcompile's on the same prompt. Decode: a "
    "random prompt of {prompt} tokens prefilled, its cache loaded into generate.StaticStep (the decode step of "
    "all layers captured as one CUDA graph for a bucket of B rows: what RunningTensorLM.generate replays), "
    "{warmup} warm-up steps, then CUDA events around each step (copy of the B input tokens + graph replay; "
    "sampling not included), median of --repeats; tokens/s = B / step time. rtcompile+stacked (decode): the "
    "same with each layer's five input maps computed as one matrix product on their stacked weights. "
    "rtcompile+compile (decode, CUDA only): stacked, and the step fused by torch.compile(fullgraph=True) with "
    "generate.STEP_INDUCTOR_OPTIONS (inductor's combo kernels) before capture (generate(compile_step=True) "
    "without the fused layer step); "
    "its compile is part of the warm-up, never timed. rtcompile+layers (decode, CUDA only): compiled as "
    "rtcompile+compile, with each layer whose decode config covers a head's value row running its step "
    "between the matrix products as one kernel (StaticStep(fuse_layers=True), kernels/layer_step.py; "
    "the other layers as rtcompile+compile): what generate(compile_step=True) replays."
).format(vocab=VOCAB, seed=SEED, backend=RT_BACKEND, fla_k=FLA_MAX_K, warmup=WARMUP_PASSES,
         graph_ms=GRAPH_BELOW_S * 1e3, prompt=DECODE_PROMPT_T)


@dataclass(frozen=True)
class ModelBenchOptions:
    spec: ModelSpec
    spec_path: str = ""
    quick: bool = False
    out: Path | None = None
    repeats: int = DEFAULT_REPEATS
    budget_s: float = DEFAULT_BUDGET_S
    only: tuple[str, ...] = ()  # keep the cases whose name contains one of these (all when empty)

    def __post_init__(self) -> None:
        check_run_options(self.repeats, self.budget_s)


def model_cases(spec: ModelSpec, quick: bool = False, only: Sequence[str] = ()) -> list[Case]:
    """The run's cases in order: prefill at B1 and B8, then decode at each batch; ``fla`` beside
    ``rtcompile`` only where K <= FLA_MAX_K (fla-core 0.6.0's chunk kernel asserts it)."""
    impls = (IMPL_RT, IMPL_FLA) if spec.key_dim <= FLA_MAX_K else (IMPL_RT,)
    T = QUICK_T if quick else PREFILL_T
    shape = {"key_widths": tuple(spec.key_widths), "H": spec.heads, "V": spec.value_width,
             "dtype": spec.input_dtype, "impls": impls}
    cases = [Case(f"prefill_B{B}_T{T}", "prefill", B=B, T=T, **shape) for B in PREFILL_BATCHES]
    decode_impls = (IMPL_RT, IMPL_RT_FUSED, IMPL_RT_COMPILED, IMPL_RT_LAYERS, *impls[1:])
    cases += [Case(f"decode_B{B}", "decode", B=B, T=1, **{**shape, "impls": decode_impls})
              for B in (QUICK_DECODE_BATCHES if quick else DECODE_BATCHES)]
    return [c for c in cases if not only or any(s in c.name for s in only)]


def model_dry_run_lines(options: ModelBenchOptions) -> list[str]:
    """What a run would do: the model, then one line per case (no device needed)."""
    spec = options.spec
    fla = fla_version()
    widths = "x".join(map(str, spec.key_widths))
    lines = [(f"rtcompile bench --model {options.spec_path}: order {spec.order}, key widths {widths} "
              f"(K {spec.key_dim}), {spec.layers} layers, d_model {spec.model_width}, H{spec.heads} "
              f"V{spec.value_width}, vocab {VOCAB}, {spec.input_dtype} weights, {spec.state_dtype} state; "
              f"{'quick, ' if options.quick else ''}repeats {options.repeats}, budget {options.budget_s:.0f} s, "
              f"fla-core {fla or 'not installed'}")]
    if spec.key_dim > FLA_MAX_K:
        lines.append(f"fla      not run: K={spec.key_dim} > {FLA_MAX_K} (fla-core 0.6.0's chunk kernel asserts K <= 256)")
    for c in model_cases(spec, options.quick, options.only):
        what = (f"forward over B{c.B} x T{c.T} tokens" if c.phase == "prefill"
                else f"one token per sequence, B{c.B}, CUDA-graph step of bucket {bucket_of(c.B)}")
        lines.append(f"{c.phase:8} {c.name:18} {what:58} impls: {', '.join(c.impls)}")
    return lines


# ----- the model and its fla mixer ----------------------------------------------------------------
class MixerLM(RunningTensorLM):
    """RunningTensorLM whose every forward (prefill, ``step``, the graph's captured step) uses
    ``bench_mixer`` as its state mixer when the call names none (None: our kernels)."""

    bench_mixer: Mixer | None = None

    def forward(self, tokens, cache=None, *, mixer: Mixer | None = None, **kwargs):
        return super().forward(tokens, cache, mixer=mixer if mixer is not None else self.bench_mixer, **kwargs)


def build_model(spec: ModelSpec, device: Any, vocab: int = VOCAB) -> MixerLM:
    """The benchmarked model: seeded random weights in the spec's input dtype, eval mode."""
    torch.manual_seed(SEED)
    return MixerLM(spec, vocab_size=vocab).to(device=device, dtype=getattr(torch, spec.input_dtype)).eval()


def fla_mixer(spec: ModelSpec, q: list, k: list, v: torch.Tensor, g: torch.Tensor | None,
              beta: torch.Tensor | None, state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A :data:`rtcompile.model.Mixer` running fla-core's gated delta rule on phi(q), phi(k):
    the chunk kernel for T > 1, the fused recurrent one for T = 1 (the decode step)."""
    if beta is None:
        raise NotImplementedError("fla's gated delta rule needs the delta rule (the spec's features.delta_rule)")
    B, T, H, V = v.shape
    if g is None:  # no forget gate: log decay 0 is the same model
        g = torch.zeros(B, T, H, dtype=torch.float32, device=v.device)
    phi = kronify(Inputs(q, k, v, g, beta, spec.effective_scale))
    s0 = None if state is None else state.reshape(B, H, spec.key_dim, V).float()
    ops = fla_ops()
    op = ops.fused_recurrent_gated_delta_rule if T == 1 else ops.chunk_gated_delta_rule
    o, s = op(q=phi.q[0], k=phi.k[0], v=v, g=g, beta=beta, scale=phi.scale, initial_state=s0,
              output_final_state=True, use_qk_l2norm_in_kernel=spec.features.l2norm)
    return o, s.reshape(B, H, *spec.key_widths, V)


# ----- measures -----------------------------------------------------------------------------------
def _prompt(lm: MixerLM, case: Case, T: int, device: Any) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(input_seed(case, T))
    return torch.randint(0, lm.embed.num_embeddings, (case.B, T), generator=gen, device=device)


def _use(lm: MixerLM, impl: str) -> None:
    lm.bench_mixer = fla_mixer if impl == IMPL_FLA else None


def measure_model_prefill(lm: MixerLM, case: Case, impl: str, ctx: BenchContext) -> Outcome:
    """One forward over the prompt: warm-up, peak extra memory, timing; fla's logits error."""
    if impl == IMPL_FLA and (why := fla_refusal(case)):
        return Outcome(note=why)
    tokens = _prompt(lm, case, case.T, ctx.device)
    calls = [lambda: lm(tokens, backend=RT_BACKEND)[0]]
    _use(lm, impl)
    try:
        warm_up(calls, ctx)
        got = calls[0]() if impl == IMPL_FLA else None
        peak = peak_extra_bytes(calls[0], ctx)
        t = time_calls(calls, ctx)
    finally:
        _use(lm, IMPL_RT)
    err = None if got is None else rel_rms(got, calls[0]())  # against ours, on the same prompt
    note = "" if err is None else f"logits vs rtcompile's: rel RMS {err:.1e}"
    return Outcome(seconds=t.seconds, timing=t.method, peak_extra_mem_bytes=peak, rel_rms_err=err, note=note)


def measure_model_decode(lm: MixerLM, case: Case, impl: str, ctx: BenchContext) -> Outcome:
    """generate's decode step for a bucket, captured as a CUDA graph (run eagerly off CUDA) from a
    prefilled prompt's cache: warm-up steps, then CUDA events around each step."""
    if impl == IMPL_FLA and (why := fla_refusal(case)):
        return Outcome(note=why)
    compiled = impl in (IMPL_RT_COMPILED, IMPL_RT_LAYERS)
    if compiled and not ctx.is_cuda:
        return Outcome(note="compiled step: measured on CUDA only (an inductor compile per bucket)")
    _use(lm, impl)
    try:
        logits, cache = lm(_prompt(lm, case, DECODE_PROMPT_T, ctx.device), backend=RT_BACKEND)
        bucket = bucket_of(case.B)
        step = StaticStep(lm, bucket, RT_BACKEND, capture=ctx.is_cuda, compiled=compiled,
                          fuse_projections=impl in (IMPL_RT_FUSED, IMPL_RT_COMPILED, IMPL_RT_LAYERS),
                          fuse_layers=impl == IMPL_RT_LAYERS)
        step.load(cache, case.B)
        del cache
        tok = logits[:, -1].argmax(-1)
        calls = [lambda: step(tok)]
        warm_up(calls, ctx)
        t = time_calls(calls, ctx, graph=False)  # the call is a graph replay already
    finally:
        _use(lm, IMPL_RT)
    how = f"CUDA graph of the step (bucket {bucket})" if ctx.is_cuda else f"static step run eagerly (bucket {bucket})"
    return Outcome(seconds=t.seconds, timing=f"{how}; {t.method}")


MEASURES: dict[str, Callable[[MixerLM, Case, str, BenchContext], Outcome]] = {
    "prefill": measure_model_prefill, "decode": measure_model_decode,
}


def case_tokens(case: Case) -> Work:
    """Tokens per timed call (B*T prefill, B decode); no bytes or FLOPs: the rows are tokens/s."""
    return Work(0.0, 0.0, case.B * case.T)


# ----- the run ------------------------------------------------------------------------------------
def model_header(options: ModelBenchOptions, ctx: BenchContext) -> dict[str, Any]:
    """The kernel bench's header (GPU, versions, commit, date) with this run's spec and method."""
    header = collect_header(BenchOptions(phase="model", quick=options.quick, out=options.out,
                                         repeats=options.repeats, budget_s=options.budget_s), ctx)
    for key in ("ceilings", "l2_bytes"):  # neither is measured or used here
        header.pop(key, None)
    header.update(method=MODEL_METHOD, spec=options.spec.to_dict(), spec_path=options.spec_path, vocab=VOCAB,
                  weights_dtype=options.spec.input_dtype, backend=RT_BACKEND, seed=SEED)
    return header


def run_model_bench(options: ModelBenchOptions, *, device: Any = None, file: Any = None,
                    log: Any = None) -> list[Row]:
    """Measure every case of ``options`` (a CPU ``device`` for tests), writing ``model.json`` and
    ``model.csv`` into ``options.out`` after every case; the table goes to ``file``, printed last."""
    device = torch.device(device or "cuda")
    log = log or sys.stderr
    ctx = BenchContext(device, options.repeats, l2_bytes=0, deadline=Deadline(options.budget_s))
    header = model_header(options, ctx)
    lm = build_model(options.spec, device)
    rows: list[Row] = []

    def flush() -> None:
        header["elapsed_s"] = round(ctx.deadline.elapsed(), 1)
        if options.out is not None:
            write_results(options.out, header, rows, stem="model")

    try:
        with torch.no_grad():
            for case in model_cases(options.spec, options.quick, options.only):
                for impl in case.impls:
                    measure = lambda case=case, impl=impl: MEASURES[case.phase](lm, case, impl, ctx)
                    row = run_one(case, impl, measure, work=case_tokens(case), ceilings=Ceilings(),
                                  deadline=ctx.deadline)
                    rows.append(row)
                    print(progress_line(row, ctx.deadline.elapsed()), file=log, flush=True)
                flush()
    finally:
        flush()  # a failed or interrupted run still leaves what it measured
    print_model_table(rows, header, file or sys.stdout)
    return rows

