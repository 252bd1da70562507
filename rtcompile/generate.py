"""Autoregressive generation for :class:`~rtcompile.model.RunningTensorLM`: one prefill forward,
then one decode step per new token.

On CUDA the decode step of all layers (:meth:`RunningTensorLM.step`: ~100 small launches, so
host-bound at 2.1-2.8 ms eager at B1 on the H200, against 148 us for the same step replayed
as one CUDA graph) is captured once per batch-size bucket into a ``torch.cuda.CUDAGraph``
with static buffers: the input tokens, the state cache (updated in place by the step), the
convolution tails and the output logits. Buckets are powers of two, so a model serving every
batch from 1 to 256 captures at most 9 graphs; a batch that does not fill its bucket takes
the first rows, and the remaining padding slots decode token 0 from a zero state (rows never
mix, so they cannot change the real rows; their work is discarded). Sampling runs outside
the graph, on the replayed logits, so a seeded generator gives the same tokens as the eager
loop.
"""

from __future__ import annotations

import math

import torch

from .functional import BACKENDS
from .fields import dtype_error
from .model import RunningTensorLM, device_memory_bytes, step_state_dtype

MODES = ("eager", "static", "graph")
WARMUP_STEPS = 3  # PyTorch's CUDA-graph notes warm up a few iterations on a side stream (Triton JIT, cuBLAS handles)
# The generated ids are one [B, max_new_tokens] int64 buffer, allocated before the prefill: 2**31
# of them (16 GiB; at ~1 ms a step, weeks of decoding) bound it where the device's memory does not.
MAX_OUTPUT_TOKENS = 1 << 31


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_output_size(max_new_tokens: int, batch: int, device) -> None:
    """ValueError naming max_new_tokens when its [batch, max_new_tokens] int64 output could not
    be allocated: more than MAX_OUTPUT_TOKENS elements, or more bytes than the device holds."""
    limit, why = MAX_OUTPUT_TOKENS // batch, f"at most 2**{MAX_OUTPUT_TOKENS.bit_length() - 1} tokens in all"
    memory = device_memory_bytes(device)
    if memory is not None and memory // (8 * batch) < limit:
        limit, why = memory // (8 * batch), f"their int64 ids within the {memory} bytes of {device} memory"
    if max_new_tokens > limit:
        raise ValueError(f"max_new_tokens: got {max_new_tokens}; allowed: an integer from 0 to {limit} "
                         f"(the output holds {batch} sequences x max_new_tokens tokens, {why})")


def check_generate_args(model, tokens, max_new_tokens, temperature, top_k, seed, cuda_graph, backend) -> bool:
    """Refuse bad arguments before any work (TypeError for a wrong type, ValueError naming the
    field and what is allowed); returns whether the decode loop uses CUDA graphs."""
    if not isinstance(tokens, torch.Tensor):
        raise TypeError(f"tokens: expected a torch.Tensor, got {type(tokens).__name__}")
    if tokens.dtype not in (torch.int32, torch.int64):
        raise dtype_error("tokens", tokens.dtype, "torch.int64, torch.int32")
    if tokens.dim() != 2 or tokens.shape[0] < 1 or tokens.shape[1] < 1:
        raise ValueError(f"tokens: shape {list(tokens.shape)}; allowed: [B, T] with B >= 1 and T >= 1 (a prompt per row)")
    device = model.embed.weight.device
    if tokens.device != device:
        raise ValueError(f"tokens: on {tokens.device}, the model on {device}; allowed: the model's device")
    vocab = model.embed.num_embeddings
    if not _is_int(max_new_tokens):
        raise TypeError(f"max_new_tokens: expected an int, got {type(max_new_tokens).__name__}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens: got {max_new_tokens}; allowed: an integer >= 0")
    check_output_size(max_new_tokens, tokens.shape[0], device)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"temperature: expected a float, got {type(temperature).__name__}")
    try:  # an int past float's range (10**400) is not finite as a float: refused, not an OverflowError
        finite = math.isfinite(temperature)
    except OverflowError:
        finite = False
    if not finite or temperature < 0:
        raise ValueError(f"temperature: got {temperature!r}; allowed: 0 (greedy) or a finite float > 0 (sampling)")
    if top_k is not None:
        if not _is_int(top_k):
            raise TypeError(f"top_k: expected an int or None, got {type(top_k).__name__}")
        if not 1 <= top_k <= vocab:
            raise ValueError(f"top_k: got {top_k}; allowed: None or an integer from 1 to {vocab} (the vocabulary)")
    if seed is not None:
        if not _is_int(seed):
            raise TypeError(f"seed: expected an int or None, got {type(seed).__name__}")
        if not 0 <= seed < 2**63:
            raise ValueError(f"seed: got {seed}; allowed: None or an integer from 0 to 2**63 - 1")
    if cuda_graph is not None and not isinstance(cuda_graph, bool):
        raise TypeError(f"cuda_graph: expected a bool or None, got {type(cuda_graph).__name__}")
    if cuda_graph and device.type != "cuda":
        raise ValueError(f"cuda_graph: True with the model on {device}; allowed: None or False off CUDA "
                         "(CUDA graphs need a CUDA device)")
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend: got {backend!r}; allowed: {', '.join(BACKENDS)}")
    lo, hi = int(tokens.min()), int(tokens.max())  # one sync, the last check, before the prefill
    if lo < 0 or hi >= vocab:
        raise ValueError(f"tokens: ids from {lo} to {hi}; allowed: 0 to {vocab - 1} (the vocabulary)")
    return device.type == "cuda" if cuda_graph is None else cuda_graph


def pick_next(logits: torch.Tensor, temperature: float, top_k: int | None, generator) -> torch.Tensor:
    """The next token per row of ``logits`` [B, vocab]: argmax at temperature 0, else a draw
    from softmax(logits / temperature) restricted to the ``top_k`` largest (ties at the k-th
    value kept). The rows draw from one generator in turn, so a row's tokens for a seed depend
    on the batch it is sampled in."""
    if temperature == 0:
        return logits.argmax(-1)
    # shifted so each row's largest is 0 before the division: a tiny temperature (1e-45) sends the
    # others to -inf, not every logit to +-inf (softmax of inf is NaN; multinomial then raised).
    # In float64: a temperature below float32's range (1e-300) became 0 there, and 0 / 0 is NaN
    x = logits.double()
    x = (x - x.amax(-1, keepdim=True)) / temperature
    if top_k is not None and top_k < x.shape[-1]:
        kth = x.topk(top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    return torch.multinomial(torch.softmax(x, dim=-1), 1, generator=generator)[:, 0]


def bucket_of(batch: int) -> int:
    """The batch-size bucket of ``batch`` sequences: the next power of two."""
    return 1 << (batch - 1).bit_length()


# The compiled step's inductor options. combo_kernels launches the step's independent pointwise
# kernels (each layer's five decode-kernel inputs, its norms) as one: 43 -> 26 kernels a step,
# B1 79.5 -> 63.2 us, B256 260.0 -> 238.4 us (fp32 state; bf16 state 186.8 -> 170.6 us), order 3
# 16x16 example model, H200, 2026-12-02. Inductor's GEMM autotuning on top was slower at B1 (72.9
# us: its Triton templates lose to cuBLAS at M = 1) and failed to compile some at B256.
STEP_INDUCTOR_OPTIONS = {"combo_kernels": True}


class StaticStep:
    """The decode step of ``model`` for one bucket of ``bucket`` rows, on static buffers.

    ``capture``: record the step as a CUDA graph (CUDA only) and replay it per call; False
    runs the same body eagerly on the same buffers (what CPU tests check of this class).
    ``fuse_projections``: each layer's five input maps as one matrix product on a stacked copy
    of their weights (:meth:`RunningTensorLM.input_projections`), taken here: a later in-place
    change of those weights needs a new StaticStep (``generate`` makes one: its key holds the
    parameters' versions when this is on). ``inductor_options``: torch.compile's ``options``
    for a compiled step (None: :data:`STEP_INDUCTOR_OPTIONS`; ``{}``: inductor's defaults).
    ``fuse_layers`` (with ``fuse_projections``): each dense layer whose decode config for this
    bucket can (``serving_step.fused_step_plan``) runs its step between the matrix products as
    one kernel (``kernels/layer_step.py``); the others run unfused.
    ``parts``: micro-batches of equal rows, a divisor of ``bucket``, whose stages overlap the
    others' decode kernels when captured (:class:`rtcompile.overlap.StagedStep`, an experiment:
    it measured no faster than the whole step, see there); 1 runs the model's step whole."""

    def __init__(self, model, bucket: int, backend: str, capture: bool, compiled: bool = False,
                 fuse_projections: bool = False, inductor_options: dict | None = None, parts: int = 1,
                 fuse_layers: bool = False):
        if not _is_int(parts):
            raise TypeError(f"parts: expected an int, got {type(parts).__name__}")
        if not isinstance(fuse_layers, bool):
            raise TypeError(f"fuse_layers: expected a bool, got {type(fuse_layers).__name__}")
        if fuse_layers and (not fuse_projections or parts != 1):
            # the layer kernel starts from the stacked product, and the micro-batches call the
            # layers' halves, around it: either would drop it without a word
            raise ValueError(f"fuse_layers: True with {'parts=' + str(parts) if parts != 1 else 'fuse_projections=False'}; "
                             "allowed: with fuse_projections=True and parts=1")
        if parts < 1 or bucket % parts:
            raise ValueError(f"parts: got {parts}; allowed: a divisor of the bucket, {bucket}")
        if parts > 1 and type(model).forward is not RunningTensorLM.forward:
            # the stages call the layers' halves directly: a subclass's forward (the bench's fla
            # mixer) would be skipped without a word
            raise ValueError(f"parts: got {parts} for a {type(model).__name__}, whose forward is its own; allowed: 1 "
                             "(micro-batches run RunningTensorLM's layers directly)")
        p = model.embed.weight
        self.model, self.bucket, self.backend = model, bucket, backend
        # in a CUDA graph each launch costs ~1.5 us at B1 (H200): the stacked product launches one
        # matrix product per layer where the maps launch five
        self.fused = model.input_projections() if fuse_projections else None
        dtype = step_state_dtype(model.spec, model.plan, bucket, p.dtype)
        if fuse_layers:
            from .serving_step import fused_step_plan

            self.fused = [f._replace(step=fused_step_plan(layer, bucket, backend, dtype))
                          for f, layer in zip(self.fused, model.mixers)]
        # compiled: the step's ~100 small ops (per layer: norms, gates, convolution tail, skip
        # mixing) fused by torch.compile (inductor) into fewer kernels, the decode kernel called
        # in place as the custom op rtcompile::running_tensor_decode_ (no copy of the state: the
        # mutation is re-inplaced); in a CUDA graph each launch left costs ~1.5 us at B1 (148 us
        # for the ~100 launches of the uncompiled step, H200). Costs one compile per bucket.
        options = STEP_INDUCTOR_OPTIONS if inductor_options is None else inductor_options
        if parts == 1:
            self._step = torch.compile(model.step, fullgraph=True, options=options or None) if compiled else model.step
        self.tokens = torch.zeros(bucket, dtype=torch.int64, device=p.device)
        # the state cache and tails as a step would have them after its first in-place update, in
        # the shapes forward checks a cache against (model.cache_layout; a zero-prompt prefill of
        # the bucket made them before)
        rest, tail_len, tails = model.cache_layout
        self.cache = [{"state": torch.zeros(bucket, *rest, dtype=dtype, device=p.device),
                       "conv": [torch.zeros(bucket, tail_len, ch, dtype=p.dtype, device=p.device) for ch in tails]
                       if tails else None} for _ in model.mixers]
        self.logits = None
        self.graph = None
        self._staged = self._streams = None
        if parts > 1:
            from .overlap import StagedStep, Streams

            self._staged = StagedStep(model, parts, backend, dtype, self.fused, compiled, options)
            self.logits = torch.empty(bucket, model.head.out_features, dtype=p.dtype, device=p.device)
            self._streams = Streams.make(parts, p.device) if capture else None
        if capture:
            self._capture()

    def _body(self) -> torch.Tensor:
        if self._staged is not None:
            self._staged(self.tokens, self.cache, self.logits, self._streams)
            return self.logits
        logits, new = self._step(self.tokens, self.cache, backend=self.backend, fused=self.fused)
        for static, c in zip(self.cache, new):
            # the state is updated in place (same tensor); a converted copy would be copied back
            if c["state"] is not static["state"]:
                static["state"].copy_(c["state"])
            for dst, src in zip(static["conv"] or [], c["conv"] or []):
                if src is not dst:  # the step shifts its tails in place: no copy onto itself
                    dst.copy_(src)
        return logits

    def _capture(self) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), torch.cuda.stream(side):
            for _ in range(WARMUP_STEPS):  # compiles the kernels; only the zero buffers change
                self._body()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.no_grad(), torch.cuda.graph(graph):
                self.logits = self._body()
        except RuntimeError as exc:  # e.g. a host sync in a path the step takes (backend, plan)
            raise RuntimeError(f"cuda_graph: capturing the decode step of bucket {self.bucket} failed "
                               f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}); "
                               "allowed: cuda_graph=False (the eager loop)") from exc
        self.graph = graph

    def load(self, cache: list, batch: int) -> None:
        """Copy a prefill's cache of ``batch`` sequences into the first rows; zero the padding."""
        with torch.no_grad():
            for static, c in zip(self.cache, cache):
                static["state"][:batch].copy_(c["state"])
                static["state"][batch:].zero_()
                for dst, src in zip(static["conv"] or [], c["conv"] or []):
                    dst[:batch].copy_(src)
                    dst[batch:].zero_()
            self.tokens.zero_()

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        """One step for ``tokens`` [batch <= bucket]: logits [batch, vocab] (a view of the static
        output, overwritten by the next call)."""
        batch = tokens.shape[0]
        self.tokens[:batch].copy_(tokens)
        if self.graph is not None:
            self.graph.replay()
            return self.logits[:batch]
        with torch.no_grad():
            return self._body()[:batch]


def _steppers(model, backend: str, capture: bool, compiled: bool = False) -> dict[int, StaticStep]:
    """The model's captured steps per bucket, kept across calls; rebuilt when what a graph holds
    pointers to or decided from changes (parameters moved or cast, another plan, backend) and,
    for a compiled step (its input maps stacked: a copy), when a parameter changed in place."""
    params = tuple((p.data_ptr(), p.dtype, p._version if compiled else 0) for p in model.parameters())
    key = (backend, capture, compiled, id(model.plan), params)
    held = model.__dict__.get("_generate_steppers")
    if held is None or held[0] != key:
        held = (key, {})
        model.__dict__["_generate_steppers"] = held
    return held[1]


def run_generate(model, tokens: torch.Tensor, max_new_tokens: int, *, temperature: float = 0.0, top_k=None,
                 seed=None, mode: str = "eager", backend: str = "auto", compile_step: bool = False) -> torch.Tensor:
    """The loop behind :func:`generate`, on checked arguments. ``mode``: "eager" (the model's
    ``step``), "static" (the graph's static buffers and padding, run eagerly: testable on the
    CPU) or "graph" (captured and replayed; CUDA). ``compile_step``: the static or graph step
    with its input maps stacked, each dense layer's step between its products one kernel where
    its decode tile can (``fuse_layers``), and through torch.compile (:class:`StaticStep`)."""
    if mode not in MODES:
        raise ValueError(f"mode: got {mode!r}; allowed: {', '.join(MODES)}")
    B = tokens.shape[0]
    out = torch.empty(B, max_new_tokens, dtype=torch.int64, device=tokens.device)
    if max_new_tokens == 0:
        return out
    generator = None
    if seed is not None and temperature > 0:
        generator = torch.Generator(device=tokens.device)
        generator.manual_seed(seed)
    with torch.no_grad():
        logits, cache = model(tokens, backend=backend)
        tok = pick_next(logits[:, -1], temperature, top_k, generator)
        out[:, 0] = tok
        if max_new_tokens == 1:
            return out
        if mode == "eager":
            def step(t):  # the state is updated in place, the conv tails are new tensors: carry both
                nonlocal cache
                lg, cache = model.step(t, cache, backend=backend)
                return lg
        else:
            steppers = _steppers(model, backend, mode == "graph", compile_step)
            bucket = bucket_of(B)
            if bucket not in steppers:
                steppers[bucket] = StaticStep(model, bucket, backend, capture=mode == "graph", compiled=compile_step,
                                              fuse_projections=compile_step, fuse_layers=compile_step)
            step = steppers[bucket]
            step.load(cache, B)
        for i in range(1, max_new_tokens):
            tok = pick_next(step(tok), temperature, top_k, generator)
            out[:, i] = tok
    return out


def generate(model, tokens: torch.Tensor, max_new_tokens: int, *, temperature: float = 0.0, top_k: int | None = None,
             seed: int | None = None, cuda_graph: bool | None = None, backend: str = "auto",
             compile_step: bool = False) -> torch.Tensor:
    """Prefill ``tokens`` [B, T] (int64 or int32 ids) with one forward, then decode
    ``max_new_tokens`` tokens per sequence; returns them, [B, max_new_tokens] int64.

    Every argument is checked before any work (:func:`check_generate_args`): the ids of
    ``tokens`` within the vocabulary on any device (one sync; the model's forward checks them
    only on the CPU), ``max_new_tokens`` an integer from 0 to what one [B, max_new_tokens] int64
    output can hold (:func:`check_output_size`: 2**31 tokens in all, or the device's memory).

    ``temperature`` 0 is greedy (argmax); above 0 each token is drawn from
    softmax(logits / temperature), restricted to the ``top_k`` largest logits when given, with a
    ``torch.Generator`` seeded by ``seed`` (None: torch's global generator), so a seed repeats
    its tokens. ``cuda_graph``: None is on when the model is on CUDA; True off CUDA is refused.
    ``backend``: as :meth:`RunningTensorLM.forward`. The model's :attr:`plan` applies.
    ``compile_step``: with CUDA graphs, the captured step is first fused: each layer's input maps
    stacked into one product, each dense layer's step from that product to its gated output one
    kernel (``kernels/layer_step.py``), then torch.compile (fewer launches per replay; one
    compile per batch bucket, ~10 s on the H200); off CUDA graphs it is
    refused (the eager loop has nothing to gain from it that its host time does not swallow).
    """
    graph = check_generate_args(model, tokens, max_new_tokens, temperature, top_k, seed, cuda_graph, backend)
    if not isinstance(compile_step, bool):
        raise TypeError(f"compile_step: expected a bool, got {type(compile_step).__name__}")
    if compile_step and not graph:
        raise ValueError("compile_step: True without CUDA graphs; allowed: False, or True with the model on CUDA "
                         "and cuda_graph None or True")
    return run_generate(model, tokens, max_new_tokens, temperature=float(temperature), top_k=top_k, seed=seed,
                        mode="graph" if graph else "eager", backend=backend, compile_step=compile_step)
