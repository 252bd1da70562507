"""The decode step in micro-batches whose stages overlap each other's decode kernels (an
experiment: ``StaticStep(parts=...)``, off by default).

At a large batch the CUDA-graph decode step is two kinds of work in turn: each layer's decode
kernel, bound by the bandwidth that reads and writes its state (o3 16x16 B256, fp32 state: 148 us
of the step's ~237 for 537 MB, H200), and everything else (matrix products at M = B, norms,
gates: ~89 us, bound by launch and latency). Split into ``parts`` micro-batches, one part's
products and pointwise work can run beside another part's decode kernel, as serving engines
overlap two micro-batches (SGLang's two-batch overlap).

The schedule: each part runs the layers in order on a high-priority stream of its own; every
decode kernel runs on one low-priority stream, so the kernels run one at a time in the order
(layer, part) and the latency-bound stages on the critical path dispatch first. Rows never mix,
so a part's rows equal the whole step's up to the rounding of products at another M.

**Measured, and why it is off** (example model ``order3_16x16.toml``, compiled step with combo
kernels, ``benchmarks/profile_decode.py --parts``, wall time per replay, median of 5 x 20):

* H200 at 0bdb947 (each part's kernels on its own stream, taking turns by events): B256 fp32
  state 255.7 us in two parts, 274.5 in four, against 237.4 whole; B128 173.0 against 159.9.
* H100 at 13d22f1 (this schedule): B256 fp32 288.0 against 288.2 whole; B128 192.4 against
  180.5; B256 bf16 state 209.6 against 190.6.

The kernels beside a decode kernel slow down more than the overlap hides: in two parts at B256
(H100) the decode kernels took 206 us against 196, and the step's other kernels 230 us of
kernel time against 79, as their blocks wait for SMs the decode kernel's blocks hold (one
register-heavy block streams each state tile; the products' blocks only start where one ends).

:class:`StagedStep` holds the stages (the work between two decode kernels; each one torch.compile
unit when compiled); :class:`rtcompile.generate.StaticStep` drives it per call.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


def _enter(embed, norm, layer, fused, tokens, tails):
    """tokens [b] -> (x [b, 1, D], layer 0's mixer inputs, its output-gate pre-activation)."""
    x = embed(tokens[:, None])
    inputs, gate, _ = layer.mixer_inputs(norm(x), tails, fused, in_place=True)
    return x, inputs, gate


def _block_output(layer, mlp, x, o, gate):
    x = x + layer.mixer_output(o, gate)
    return x if mlp is None else x + mlp(x)


def _between(layer, mlp, norm, nxt, fused, x, o, gate, tails):
    """Layer l's output, residual and MLP; then layer l + 1's mixer inputs (tails shifted in place)."""
    x = _block_output(layer, mlp, x, o, gate)
    inputs, gate, _ = nxt.mixer_inputs(norm(x), tails, fused, in_place=True)
    return x, inputs, gate


def _leave(layer, mlp, final, head, x, o, gate, logits):
    """The last layer's output, residual and MLP, the final norm and head, written into ``logits``."""
    logits.copy_(head(final(_block_output(layer, mlp, x, o, gate)))[:, 0])


class StagedStep:
    """``model``'s decode step as stages between its decode kernels, run on ``parts`` equal
    micro-batches of a bucket (``parts`` divides the bucket; 1 is the whole batch, staged).

    Invariants: the cache's states and convolution tails are updated in place (views of the
    caller's buffers, one row range per micro-batch), in ``state_dtype``; ``logits`` [bucket,
    vocab] is written in place; with ``streams`` (:class:`Streams`, CUDA) each micro-batch's
    stages run on its part stream and every decode kernel on the kernel stream, one at a time in
    the order (layer, part), all forked from and joined back into the current stream. Without,
    everything runs in order on the current stream. ``compiled``: each stage through
    torch.compile with ``options`` (one graph per stage kind: the layers are arguments, not
    constants; 3 graphs for 12 layers on the CPU)."""

    def __init__(self, model, parts: int, backend: str, state_dtype: torch.dtype, fused: list | None,
                 compiled: bool, options: dict | None):
        self.model, self.parts, self.backend, self.state_dtype, self.fused = model, parts, backend, state_dtype, fused
        compile_ = (lambda f: torch.compile(f, fullgraph=True, options=options or None)) if compiled else (lambda f: f)
        self._enter, self._between, self._leave = compile_(_enter), compile_(_between), compile_(_leave)

    def _kernel(self, i: int, inputs, state: torch.Tensor) -> torch.Tensor:
        q, k, v, g, beta = inputs
        o, new = self.model.mixers[i].step_in_place(q, k, v, g, beta, state, self.model.plan, self.backend,
                                                    dtype=self.state_dtype)
        if new is not state:  # the static state is allocated in state_dtype, rows of a contiguous tensor
            raise RuntimeError(f"StagedStep: layer {i}'s state was converted, not updated in place")
        return o

    def __call__(self, tokens: torch.Tensor, cache: list, logits: torch.Tensor, streams: Streams | None) -> None:
        m = self.model
        rows = tokens.shape[0] // self.parts
        parts = [slice(j * rows, (j + 1) * rows) for j in range(self.parts)]
        fused = self.fused or [None] * len(m.mixers)
        mlps = list(m.mlps) if m.mlps is not None else [None] * len(m.mixers)
        tails = lambda i, p: None if cache[i]["conv"] is None else [t[p] for t in cache[i]["conv"]]
        if streams is not None:
            here = torch.cuda.current_stream()
            for s in (*streams.parts, streams.kernels):
                s.wait_stream(here)
        # torch.cuda.stream(None) changes nothing (also without CUDA): no streams, one stream
        part_stream = (lambda j: streams.parts[j]) if streams is not None else (lambda j: None)
        kernels = streams.kernels if streams is not None else None
        held = [None] * self.parts  # per part: (x, mixer inputs, gate pre-activation)
        outs = [None] * self.parts  # per part: (x, mixer output, gate pre-activation)
        for i, layer in enumerate(m.mixers):
            for j, p in enumerate(parts):
                with torch.cuda.stream(part_stream(j)):
                    if i == 0:
                        held[j] = self._enter(m.embed, m.norms[0], layer, fused[0], tokens[p], tails(0, p))
                    else:
                        x, o, gate = outs[j]
                        held[j] = self._between(m.mixers[i - 1], mlps[i - 1], m.norms[i], layer, fused[i], x, o,
                                                gate, tails(i, p))
                x, inputs, gate = held[j]
                if kernels is not None:  # the kernel stream takes the inputs once they are written
                    kernels.wait_stream(part_stream(j))
                    _used_on(inputs, kernels)
                with torch.cuda.stream(kernels):
                    o = self._kernel(i, inputs, cache[i]["state"][p])
                if kernels is not None:  # and the part's next stage waits for its kernel
                    part_stream(j).wait_stream(kernels)
                    o.record_stream(part_stream(j))
                outs[j] = (x, o, gate)
        last = len(m.mixers) - 1
        for j, p in enumerate(parts):
            with torch.cuda.stream(part_stream(j)):
                x, o, gate = outs[j]
                self._leave(m.mixers[last], mlps[last], m.final, m.head, x, o, gate, logits[p])
        if streams is not None:
            for s in (*streams.parts, streams.kernels):
                here.wait_stream(s)


def _used_on(tensors, stream) -> None:
    """Mark every tensor in a nested tuple / list as used on ``stream`` (the allocator then keeps
    its memory until that stream's work is done, not only its own stream's)."""
    for t in tensors:
        if isinstance(t, torch.Tensor):
            t.record_stream(stream)
        elif isinstance(t, (list, tuple)):
            _used_on(t, stream)


class Streams(NamedTuple):
    """The streams of a captured staged step: one per part (high priority: the latency-bound
    stages on the step's critical path dispatch first) and one for every decode kernel (low
    priority, so the kernels run one at a time in the order launched, (layer, part))."""

    parts: list
    kernels: object

    @classmethod
    def make(cls, parts: int, device) -> "Streams":
        # lower numbers are higher priorities; torch clamps to the device's range. PyTorch
        # instantiates graphs with cudaGraphInstantiateFlagUseNodePriority, so the captured
        # kernels keep their stream's priority on replay
        return cls([torch.cuda.Stream(device, priority=-1) for _ in range(parts)], torch.cuda.Stream(device, priority=0))
