"""RunningTensor modules built from a spec: one layer, and a small causal LM.

A layer: input projection (``dense``: one linear map to the query factors, key factors and
values, then a short causal depthwise convolution with SiLU; ``conconlyc``: each stream tiles
the model channels to its width and applies a depthwise causal convolution whose D x w weights
are tied across the tiles), forget gate (log-sigmoid), beta (sigmoid), query-skip gates (each
query factor blended with the all-ones vector per token), the state mixer
(:func:`rtcompile.running_tensor`), output gate (SiLU) with RMS norm, output projection. Its
parameter count is :func:`rtcompile.figures.parameters_per_layer` exactly.

``forward`` runs a prompt (prefill) and returns the state cache; ``step`` runs one token per
sequence from a cache. A cache is a list (one per layer) of dicts with the mixer state
``[B, H, d_1, ..., d_v]`` (fp32) and the convolution tail ``[B, w - 1, channels]`` (the last
w - 1 inputs, channels contiguous).

The state mixer can be replaced per call (``mixer=``, a :data:`Mixer`): the exporter
(:mod:`rtcompile.export.onnx_model`) passes one that becomes a single ONNX node. This module
knows nothing of ONNX; everything else about a layer stays the same under a replaced mixer.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .functional import BACKENDS, needs_grad, resolve_backend, running_tensor, running_tensor_decode_
from .spec import ModelSpec, SpecError
from .fields import dtype_error

# A replacement state mixer: ``mixer(spec, q, k, v, g, beta, state) -> (o, new_state)`` with q, k
# the factor lists [B, T, H, d_i], v [B, T, H, d_v], g (log decay, fp32) and beta [B, T, H] or
# None, and ``state`` the cache's [B, H, d_1, ..., d_v] or None (no cache: a zero state); ``o`` is
# [B, T, H, d_v] (RunningTensorLayer.mixer_output reads B, T, H, d_v from it).
Mixer = Callable[..., tuple[torch.Tensor, torch.Tensor]]


class InputProjection(NamedTuple):
    """A layer's input maps stacked (:meth:`RunningTensorLayer.input_projection`): ``weight``
    [sum(sizes), D], ``bias`` [sum(sizes)] or None, ``sizes`` the maps' output widths in row order;
    ``step``: the fused layer step of one batch bucket (``serving_step.FusedStep``), which a
    serving step then takes, or None (the step runs unfused)."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    sizes: tuple[int, ...]
    step: object = None


class _CausalDepthwise(nn.Module):
    """Depthwise causal 1-D convolution over [B, T, C] with a carried tail of w - 1 inputs."""

    def __init__(self, weight_channels: int, width: int):
        super().__init__()
        self.width = width
        # N(0, 1 / width) through nn.init, which the bundle check's meta build skips
        self.weight = nn.Parameter(torch.empty(weight_channels, width))
        nn.init.normal_(self.weight, std=1 / math.sqrt(width))

    def forward(self, x: torch.Tensor, weight: torch.Tensor, tail: torch.Tensor | None, in_place: bool = False):
        """(y [B, T, C], the new tail [B, w - 1, C]). At T = 1 with a tail y is a weighted sum,
        not a convolution; ``in_place`` (the serving step) also shifts the tail in place and
        returns it, so that torch.compile fuses both into its neighbours' kernels (a
        convolution is a library call that needs its input formed first: the conv, its input's
        concatenation and the tail's copy-back were 6 of the compiled B1 step's 43 launches and
        11.8 of its 76 us in kernels, H200). The tail keeps its taps outermost so that the
        step reads and shifts whole rows of channels: with the taps innermost ([B, C, w - 1])
        the fused weighted sum and shift read 6-byte strides and took 11.2 us a layer of the
        compiled B256 step (H200, torch 2.11)."""
        B, T, C = x.shape
        if T == 1 and tail is not None:  # one token: a weighted sum of the window (also in the
            # exported decode graph, where onnxruntime's Conv took 0.7 ms a layer at B8, the
            # example model's step 6.3 ms, on the CPU machine)
            # fp32 products and sum (float64 for float64), as a 16-bit convolution accumulates
            wide = torch.float64 if x.dtype == torch.float64 else torch.float32
            w = weight.to(wide)
            y = (tail.to(wide) * w[:, :-1].t()).sum(1) + x[:, 0].to(wide) * w[:, -1]
            shifted = torch.cat([tail[:, 1:], x], dim=1)
            if in_place:
                tail.copy_(shifted)
                shifted = tail
            return y.to(x.dtype)[:, None], shifted
        if tail is None:
            tail = x.new_zeros(B, self.width - 1, C)
        full = torch.cat([tail.transpose(1, 2), x.transpose(1, 2)], dim=2)  # [B, C, w - 1 + T]
        y = F.conv1d(full, weight.unsqueeze(1), groups=C)
        return y.transpose(1, 2), full[:, :, full.shape[2] - (self.width - 1):].transpose(1, 2).contiguous()


class RunningTensorLayer(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        f = spec.features
        D, H, V = spec.model_width, spec.heads, spec.value_width
        self.widths = [H * w for w in spec.key_widths] * 2 + [H * V]  # q factors, k factors, v
        channels = sum(self.widths)
        if f.projection == "dense":
            self.proj = nn.Linear(D, channels, bias=False)
            self.conv = _CausalDepthwise(channels, f.short_conv) if f.short_conv else None
        else:
            self.proj = None
            self.conv = nn.ModuleList(_CausalDepthwise(D, f.short_conv) for _ in self.widths)
        self.forget = nn.Linear(D, H) if f.forget_gate else None
        self.beta = nn.Linear(D, H) if f.delta_rule else None
        self.skip = nn.Linear(D, H * len(spec.key_widths)) if f.query_skip else None
        if f.output_gate:
            self.gate = nn.Linear(D, H * V, bias=False)
            self.norm_weight = nn.Parameter(torch.ones(V))
        self.out = nn.Linear(H * V, D, bias=False)

    def input_map_names(self) -> list[str]:
        """The names of the layer's linear maps of its input, in the stacked product's row order."""
        return [n for n in ("proj", "forget", "beta", "skip", "gate") if getattr(self, n, None) is not None]

    def input_projection(self) -> InputProjection:
        """Every linear map the layer applies to its input (the dense projection, forget gate,
        beta, query skip, output gate), stacked into one weight [sum of outputs, D] and bias: a
        snapshot (no grad), for a decode step that launches one matrix product per layer for
        five. Rows in that order; the maps' biases where they have one, zeros elsewhere."""
        maps = [getattr(self, n) for n in self.input_map_names()]
        ref = self.out.weight  # every layer has its output map: the dtype and device
        with torch.no_grad():  # torch.cat copies: a snapshot
            weight = torch.cat([m.weight for m in maps]) if maps else ref.new_empty(0, self.spec.model_width)
            bias = None
            if any(m.bias is not None for m in maps):
                bias = torch.cat([m.bias if m.bias is not None else m.weight.new_zeros(m.out_features)
                                  for m in maps])
        return InputProjection(weight, bias, tuple(m.out_features for m in maps))

    def _projected(self, x: torch.Tensor, fused: InputProjection | None) -> dict:
        """Each input map's output by name ("proj", "forget", "beta", "skip", "gate"; absent maps
        left out): from the maps in turn, or sliced from one product with ``fused``."""
        names = self.input_map_names()
        if fused is None or not names:
            return {n: getattr(self, n)(x) for n in names}
        return dict(zip(names, F.linear(x, fused.weight, fused.bias).split(fused.sizes, dim=-1)))

    def _streams(self, x: torch.Tensor, tails, projected: torch.Tensor | None = None, in_place: bool = False):
        """The q factors, k factors and v as [B, T, channels] streams, and the new conv tails
        (``projected``: the dense projection of ``x``, when computed already; ``in_place``: the
        tails are updated in place, the serving step)."""
        if self.proj is not None:
            y = self.proj(x) if projected is None else projected
            if self.conv is None:
                return list(y.split(self.widths, dim=-1)), None
            y, tail = self.conv(y, self.conv.weight, None if tails is None else tails[0], in_place)
            return list(F.silu(y).split(self.widths, dim=-1)), [tail]
        outs, new = [], []
        D = x.shape[-1]
        for i, (conv, width) in enumerate(zip(self.conv, self.widths)):
            reps = math.ceil(width / D)
            xi = x.repeat(1, 1, reps)[..., :width]
            wi = conv.weight.repeat(reps, 1)[:width]  # tied across the tiles
            y, tail = conv(xi, wi, None if tails is None else tails[i], in_place)
            outs.append(y)
            new.append(tail)
        return outs, new

    def forward(self, x: torch.Tensor, cache: dict | None = None, *, plan=None, backend: str = "auto",
                update_cache: bool = False, mixer: Mixer | None = None, fused: InputProjection | None = None):
        """x [B, T, D] -> (y [B, T, D], new cache).

        ``mixer`` (a :data:`Mixer`) replaces the state mixer (``plan``, ``backend`` and
        ``update_cache`` then do not apply to it); the exporter's ONNX node is one.

        ``fused`` (this layer's :meth:`input_projection`) computes the input maps as one matrix
        product (same values up to the product's rounding; no gradient reaches the layer's own
        parameters through it). With its ``step`` set, the serving step (below) runs the layer's
        whole decode step but the products as one kernel (``serving_step.fused_step``).

        ``update_cache`` (T = 1 with a cache: the serving step) updates the cache's state in
        place, kept in the decode decision's state dtype (:func:`decode_state_dtype`), through
        the Triton decode kernel's slot update where it runs; the returned cache holds that
        same state tensor (converted once when its dtype or layout differs, e.g. after prefill),
        and the convolution tails are shifted in place too (the same tensors come back).
        """
        step = update_cache and cache is not None and x.shape[1] == 1
        if step and mixer is None and fused is not None and fused.step is not None and backend != "reference" \
                and not (torch.is_grad_enabled() and (x.requires_grad or self.out.weight.requires_grad)):
            from .serving_step import fused_step  # (no backward: with grad the step runs unfused)

            return fused_step(self, x, cache, fused, plan)
        (q, k, v, g, beta), gate, tails = self.mixer_inputs(x, None if cache is None else cache.get("conv"), fused,
                                                            in_place=step and mixer is None)
        spec = self.spec
        if mixer is not None:
            o, state = mixer(spec, q, k, v, g, beta, None if cache is None else cache["state"])
        elif step:
            o, state = self.step_in_place(q, k, v, g, beta, cache["state"], plan, backend)
        else:
            # a spec's fixed chunk size is the chunk size without a plan too (it was the plan's and
            # the ONNX graph's only, so a plan-less model ran the tuned table's or the default's C)
            fixed = None if plan is not None or spec.chunk_size == "auto" else spec.chunk_size
            o, state = running_tensor(q, k, v, g, beta, scale=spec.scale,
                                      initial_state=None if cache is None else cache["state"],
                                      output_final_state=True, l2norm=spec.features.l2norm, plan=plan,
                                      backend=backend, chunk_size=fixed)
        return self.mixer_output(o, gate), {"state": state, "conv": tails}

    def mixer_inputs(self, x: torch.Tensor, tails: list | None, fused: InputProjection | None = None,
                     in_place: bool = False):
        """x [B, T, D] -> ((q factors, k factors, v, g, beta): the state mixer's inputs, contiguous;
        the output gate's pre-activation or None; the new convolution tails). ``tails``: the
        cache's (None: zeros); ``in_place``: shifted in place (the serving step). The first half
        of :meth:`forward`, apart so that a staged decode step can run the mixer between."""
        spec = self.spec
        B, T, _ = x.shape
        H, o1 = spec.heads, len(spec.key_widths)
        pre = self._projected(x, fused)
        streams, tails = self._streams(x, tails, pre.get("proj"), in_place=in_place)
        heads = lambda t, w: t.reshape(B, T, H, w)
        q = [heads(s, w) for s, w in zip(streams[:o1], spec.key_widths)]
        k = [heads(s, w) for s, w in zip(streams[o1:2 * o1], spec.key_widths)]
        v = heads(streams[-1], spec.value_width)
        if self.skip is not None:
            s = torch.sigmoid(pre["skip"]).reshape(B, T, H, o1)
            q = [s[..., i : i + 1] * qi + (1 - s[..., i : i + 1]) for i, qi in enumerate(q)]
        g = F.logsigmoid(pre["forget"]).float() if self.forget is not None else None
        beta = torch.sigmoid(pre["beta"]) if self.beta is not None else None
        q, k, v = [qi.contiguous() for qi in q], [ki.contiguous() for ki in k], v.contiguous()
        beta = None if beta is None else beta.contiguous()
        return (q, k, v, g, beta), pre.get("gate"), tails

    def mixer_output(self, o: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """The mixer's output o [B, T, H, d_v] -> y [B, T, D]: RMS norm and the output gate (its
        pre-activation ``gate`` from :meth:`mixer_inputs`) where the spec has one, then the
        output map. The second half of :meth:`forward`."""
        B, T, H, V = o.shape
        if self.spec.features.output_gate:
            o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm_weight
            o = o * F.silu(gate.reshape(B, T, H, V))
        return self.out(o.reshape(B, T, H * V))

    def slot_indices(self, batch: int, device: torch.device) -> torch.Tensor:
        """Slot i for sequence i, made once per (batch, device): an arange per layer and step
        would be one more launch on the decode hot path. Under torch.compile a plain arange (the
        compiled step captures it once): torch 2.11's dynamo cannot trace the cache's
        ``__dict__.setdefault`` (the H200's compiled decode step failed on it, 2026-12-02)."""
        if torch.compiler.is_compiling():
            return torch.arange(batch, dtype=torch.int32, device=device)
        cache = self.__dict__.setdefault("_slot_cache", {})
        key = (batch, device)
        if key not in cache:
            cache[key] = torch.arange(batch, dtype=torch.int32, device=device)
        return cache[key]

    def step_in_place(self, q, k, v, g, beta, state: torch.Tensor, plan, backend: str,
                      dtype: torch.dtype | None = None):
        """The mixer at T = 1 on a cache's ``state``, updated in place (in ``dtype``, default the
        step's state dtype for this batch, :func:`step_state_dtype`; converted once, and the
        converted tensor returned, where it differs): (o, state)."""
        spec = self.spec
        B = v.shape[0]
        dtype = step_state_dtype(spec, plan, B, v.dtype) if dtype is None else dtype
        state = as_step_state(state, dtype)
        grad = needs_grad(*q, *k, v, g, beta, state)
        if resolve_backend(backend, v, spec.order, grad) == "triton":
            o = running_tensor_decode_(q, k, v, g, beta, state_cache=state, state_indices=self.slot_indices(B, v.device),
                                       scale=spec.scale, l2norm=spec.features.l2norm, validate=False)
        else:  # the same semantics on the reference: fp32 step, state rounded to its dtype in place
            wide = torch.float64 if v.dtype == torch.float64 else torch.float32
            o, new = running_tensor(q, k, v, g, beta, scale=spec.scale, initial_state=state.to(wide),
                                    output_final_state=True, l2norm=spec.features.l2norm, mode="recurrent",
                                    backend="reference")
            with torch.no_grad():
                state.copy_(new)
        return o, state


def decode_state_dtype(spec: ModelSpec, plan, batch: int) -> torch.dtype:
    """The dtype a decode cache keeps its state in: the plan's decode decision for the nearest
    batch, else the spec's ``state_dtype`` (fp32 for "auto" without a plan)."""
    name = "float32" if spec.state_dtype == "auto" else spec.state_dtype
    if plan is not None:
        from .plan import PlanError

        try:
            name = plan.decision_for("decode", batch, 1).state_dtype
        except PlanError:
            pass  # a plan without decode decisions leaves the spec's choice
    return getattr(torch, name)


def step_state_dtype(spec: ModelSpec, plan, batch: int, activations: torch.dtype) -> torch.dtype:
    """The dtype the in-place step keeps a cache's state in for ``batch`` sequences whose
    activations are ``activations``: float64 for a float64 model (the reference, for checking),
    else :func:`decode_state_dtype`. The CUDA-graph decoder allocates its static state in it, so
    the captured step converts nothing."""
    return torch.float64 if activations == torch.float64 else decode_state_dtype(spec, plan, batch)


def as_step_state(state: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``state`` as the in-place step updates it: itself when already contiguous in ``dtype``,
    else a converted copy made once (the step returns it for the caller's cache)."""
    return state if state.dtype == dtype and state.is_contiguous() else state.to(dtype).contiguous()


@functools.lru_cache(maxsize=None)
def _device_memory_bytes(device: str) -> int | None:
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_properties(dev).total_memory
    if dev.type == "cpu":
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):  # pragma: no cover -- not POSIX
            return None
    return None


def device_memory_bytes(device) -> int | None:
    """Total memory of ``device`` (a CUDA GPU's, or this host's RAM for the CPU), None if unknown;
    read once per device (a model's every forward asks)."""
    return _device_memory_bytes(str(torch.device(device)))


class ModelSizeError(SpecError):
    """Parameters or states that cannot fit the device's memory: one line naming the field to
    reduce first, ``spec.<field>`` for a spec field or ``vocab_size`` (the vocabulary is the
    model's, not the spec's). A SpecError, so the command line reports it as an input error."""

    def __init__(self, field_name: str, message: str):
        ValueError.__init__(self, f"{field_name}: {message}")
        self.field = field_name


def check_memory(needed: int, what: str, device, field: str = "spec.key_widths",
                 reduce: str = "reduce key_widths, value_width, heads, layers or the batch") -> None:
    """ModelSizeError (``field`` first, ``reduce`` last) naming the bytes ``what`` needs when they
    exceed the device's whole memory: the allocation could only fail, as a raw allocator error
    mid-way."""
    total = device_memory_bytes(device)
    if total is not None and needed > total:
        raise ModelSizeError(field, f"{what}: {needed} bytes needed ({needed / 2**30:.1f} GiB), more than the "
                                    f"{total} bytes ({total / 2**30:.1f} GiB) of {torch.device(device)} memory; {reduce}")


def check_parameter_memory(spec: ModelSpec, vocab_size: int, mlp: bool, tie_embeddings: bool) -> None:
    """The fp32 parameters against the device's memory, before any is allocated: the refusal
    names the largest part's field (vocab_size for the embedding and head) and each part's
    parameter count."""
    parts = parameter_parts(spec, vocab_size, mlp, tie_embeddings)
    largest = max(parts, key=parts.get)
    field, reduce = {
        "embedding and head": ("vocab_size", "reduce vocab_size (or model_width)"),
        "mixers": ("spec.key_widths", "reduce key_widths, value_width, heads, model_width or layers"),
        "MLPs": ("spec.model_width", "reduce model_width or layers, or build without the MLPs (mlp=False)"),
    }[largest]
    tables = 1 if tie_embeddings else 2
    counts = ", ".join(f"{name} {n:,}" for name, n in parts.items() if n)
    reduce = (f"parameters by part: {counts} (the embedding and head: {tables} x vocab_size {vocab_size:,} x "
              f"model_width {spec.model_width}); {reduce}")
    check_memory(4 * sum(parts.values()), "RunningTensorLM: the fp32 parameters", torch.get_default_device(), field,
                 reduce)


def parameter_parts(spec: ModelSpec, vocab_size: int, mlp: bool, tie_embeddings: bool = False) -> dict[str, int]:
    """Parameters of a RunningTensorLM by part, before building it: the embedding and head (one
    table when tied), the mixers with their norms and the final norm, the MLPs."""
    from .figures import parameters_per_layer

    D = spec.model_width
    per_mlp = D + D * 4 * D + 4 * D + 4 * D * D + D if mlp else 0  # norm, up (with bias), down (with bias)
    tables = 1 if tie_embeddings else 2
    return {"embedding and head": tables * vocab_size * D,
            "mixers": D + spec.layers * (parameters_per_layer(spec) + D), "MLPs": spec.layers * per_mlp}


def parameter_count(spec: ModelSpec, vocab_size: int, mlp: bool, tie_embeddings: bool = False) -> int:
    """Parameters of a RunningTensorLM (embedding, head unless tied, layers, norms, MLPs), before
    building it."""
    return sum(parameter_parts(spec, vocab_size, mlp, tie_embeddings).values())


def state_bytes(spec: ModelSpec, batch: int, dtype: torch.dtype = torch.float32) -> int:
    """Bytes of the states of ``batch`` sequences, all layers, at ``dtype``."""
    return batch * spec.layers * spec.heads * spec.state_elements_per_head * dtype.itemsize


def _tracing(tokens: torch.Tensor) -> bool:
    """Is a graph being captured (torch.compile, torch.export, make_fx)? The eager call checked."""
    exporting = getattr(torch.compiler, "is_exporting", lambda: False)
    return torch.compiler.is_compiling() or exporting() or type(tokens) is not torch.Tensor


def _cache_layout(spec: ModelSpec, widths: list[int]) -> tuple[tuple[int, ...], int, tuple[int, ...]]:
    """What a layer's cache holds past its batch dimension: the state's [H, d_1, ..., d_v], the
    convolution tails' length w - 1 and their channels (one tail for the dense projection, one
    per stream for conconlyc, none without a convolution)."""
    w = spec.features.short_conv
    tails = () if w == 0 else (sum(widths),) if spec.features.projection == "dense" else tuple(widths)
    return (spec.heads, *spec.key_widths, spec.value_width), w - 1, tails


# what a cache's state may be held in: the step's dtypes, and float64 for a float64 model's reference
CACHE_STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _check_cache(model, cache, B: int, device) -> None:
    """``cache`` as forward returns it for ``B`` sequences of ``model``: shapes only (host side,
    ~1 us a layer)."""
    L = len(model.mixers)
    if not isinstance(cache, (list, tuple)):
        raise TypeError(f"cache: expected None or the list of {L} per-layer dicts that forward returns, "
                        f"got {type(cache).__name__}")
    if len(cache) != L:
        raise ValueError(f"cache: {len(cache)} layers; allowed: {L} (one dict per layer, as forward returns)")
    rest, tail_len, tails = model.cache_layout
    for i, c in enumerate(cache):
        state = c.get("state") if isinstance(c, dict) else None
        if not isinstance(state, torch.Tensor):
            raise TypeError(f"cache[{i}]: expected a dict with 'state' (a tensor) and 'conv', got "
                            f"{type(c).__name__ if not isinstance(c, dict) else 'a dict without a state tensor'}")
        shape = state.shape
        if len(shape) and shape[0] != B:
            raise ValueError(f"cache[{i}]['state']: holds {shape[0]} sequences, tokens {B}; allowed: the "
                             f"cache of the same {B} sequences (tokens' first dimension)")
        if shape[1:] != rest or not len(shape):
            raise ValueError(f"cache[{i}]['state']: shape {list(shape)}; allowed: [B, H, d_1, ..., d_v] = "
                             f"{[B, *rest]}")
        if state.device != device:
            raise ValueError(f"cache[{i}]['state']: on {state.device}, tokens on {device}; allowed: the same device")
        if state.dtype not in CACHE_STATE_DTYPES:  # an int64 state was cast to fp32 by step, named initial_state by forward
            raise dtype_error(f"cache[{i}]['state']", state.dtype, ', '.join(str(d) for d in CACHE_STATE_DTYPES))
        if not tails:
            continue
        conv = c.get("conv")
        ok = isinstance(conv, (list, tuple)) and len(conv) == len(tails)
        for t, ch in zip(conv if ok else (), tails):
            ok = ok and isinstance(t, torch.Tensor) and t.shape == (B, tail_len, ch)
        if not ok:
            got = [list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__ for t in conv] \
                if isinstance(conv, (list, tuple)) else type(conv).__name__
            raise ValueError(f"cache[{i}]['conv']: got {got}; allowed: {len(tails)} tails "
                             f"{[[B, tail_len, ch] for ch in tails]} (as forward returns them)")


def check_call(model, tokens, cache, plan, backend: str = "auto", update_cache: bool = False) -> None:
    """:meth:`RunningTensorLM.forward`'s arguments, host side only (see its docstring)."""
    if torch.compiler.is_compiling():
        return
    if not isinstance(backend, str) or backend not in BACKENDS:  # a misspelt one ran the reference in a step
        raise ValueError(f"backend: got {backend!r}; allowed: {', '.join(BACKENDS)}")
    if not isinstance(update_cache, bool):
        raise TypeError(f"update_cache: expected a bool, got {type(update_cache).__name__}")
    if not isinstance(tokens, torch.Tensor):
        raise TypeError(f"tokens: expected a torch.Tensor of token ids [B, T], got {type(tokens).__name__}")
    if tokens.dtype not in (torch.int64, torch.int32):
        raise dtype_error("tokens", tokens.dtype, "torch.int64, torch.int32 (token ids)")
    if _tracing(tokens):
        return
    if tokens.dim() != 2 or tokens.shape[0] < 1 or tokens.shape[1] < 1:
        raise ValueError(f"tokens: shape {list(tokens.shape)}; allowed: [B, T] with B >= 1 and T >= 1")
    device = model.embed.weight.device
    if tokens.device != device:
        raise ValueError(f"tokens: on {tokens.device}, the model on {device}; allowed: the model's device")
    if plan is not None:
        from .plan import Plan

        if not isinstance(plan, Plan):
            raise TypeError(f"plan: expected a rtcompile.plan.Plan (Plan.load(path), make_plan) or None, "
                            f"got {type(plan).__name__} (plan= or the model's .plan)")
    if update_cache and (cache is None or tokens.shape[1] != 1):  # was ignored: a new state came back
        raise ValueError(f"update_cache: True with {'no cache' if cache is None else f'T = {tokens.shape[1]}'}; "
                         "allowed: a cache and T = 1 (the serving step)")
    if cache is not None:
        _check_cache(model, cache, tokens.shape[0], device)
    if device.type == "cpu":  # no sync on the CPU: the ids' range is free to check here
        vocab = model.embed.num_embeddings
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= vocab:
            raise ValueError(f"tokens: ids from {lo} to {hi}; allowed: 0 to {vocab - 1} (the vocabulary)")


class RunningTensorLM(nn.Module):
    """Embedding, ``spec.layers`` pre-norm blocks (mixer, then an optional MLP), norm, head."""

    def __init__(self, spec: ModelSpec, vocab_size: int = 256, mlp: bool = True, tie_embeddings: bool = False):
        """``tie_embeddings``: the head shares the embedding's matrix (as Zoology's recall models
        do; see ``explore/trainer.py`` for what it changes on MQAR); its ``state_dict`` then
        holds the one tensor under both names."""
        super().__init__()
        if not isinstance(spec, ModelSpec):
            raise TypeError(f"spec: expected a ModelSpec (rtcompile.ModelSpec(...), ModelSpec.from_dict(d) or "
                            f"rtcompile.load_spec(path)), got {type(spec).__name__}")
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
            raise TypeError(f"vocab_size: expected an integer >= 2, got {type(vocab_size).__name__} {vocab_size!r}")
        if vocab_size < 2:
            raise ValueError(f"vocab_size: got {vocab_size}; allowed: an integer >= 2")
        for name, flag in (("mlp", mlp), ("tie_embeddings", tie_embeddings)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name}: expected a bool, got {type(flag).__name__}")
        self.spec = spec
        D = spec.model_width
        check_parameter_memory(spec, vocab_size, mlp, tie_embeddings)
        self.embed = nn.Embedding(vocab_size, D)
        self.mixers = nn.ModuleList(RunningTensorLayer(spec) for _ in range(spec.layers))
        self.norms = nn.ModuleList(nn.RMSNorm(D) for _ in range(spec.layers))
        self.mlps = nn.ModuleList(
            nn.Sequential(nn.RMSNorm(D), nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D)) for _ in range(spec.layers)
        ) if mlp else None
        self.final = nn.RMSNorm(D)
        self.head = nn.Linear(D, vocab_size, bias=False)
        if tie_embeddings:
            self.head.weight = self.embed.weight
        self.plan = None  # a Plan to follow (set by rtcompile.load from the bundle)
        self.cache_layout = _cache_layout(spec, self.mixers[0].widths)  # what forward checks a cache against

    def forward(self, tokens: torch.Tensor, cache: list | None = None, *, plan=None, backend: str = "auto",
                update_cache: bool = False, mixer: Mixer | None = None, fused: list | None = None):
        """tokens [B, T] -> (logits [B, T, vocab], cache): a prompt, or T tokens after a cache.
        ``update_cache``, ``mixer`` and ``fused`` (one per layer: :meth:`input_projections`): see
        :meth:`RunningTensorLayer.forward` (``update_cache``: T = 1 only).

        Checked first, on the host only (no device sync: this runs per token when decoding):
        ``tokens`` an int64 / int32 tensor [B, T], B, T >= 1, on the model's device; ``cache`` None
        or one dict per layer whose state and convolution tails are this model's for the same B
        sequences; ``plan`` a Plan or None. TypeError / ValueError naming the argument. The ids'
        range is checked here only for CPU tokens (free there); :meth:`generate` checks it on
        any device (one sync, before its prefill)."""
        plan = plan if plan is not None else self.plan
        check_call(self, tokens, cache, plan, backend, update_cache)
        # a replaced mixer (the ONNX exporter's) allocates no state here; under tracing the
        # eager call has checked already
        if mixer is None and not torch.compiler.is_compiling():
            wide = torch.float64 if self.embed.weight.dtype == torch.float64 else torch.float32
            check_memory(state_bytes(self.spec, tokens.shape[0], wide), f"the state of {tokens.shape[0]} sequences",
                         tokens.device)
        x = self.embed(tokens)
        new = []
        for i, layer in enumerate(self.mixers):
            y, c = layer(self.norms[i](x), None if cache is None else cache[i], plan=plan, backend=backend,
                         update_cache=update_cache, mixer=mixer, fused=None if fused is None else fused[i])
            x = x + y
            if self.mlps is not None:
                x = x + self.mlps[i](x)
            new.append(c)
        return self.head(self.final(x)), new

    def step(self, tokens: torch.Tensor, cache: list, *, backend: str = "auto", fused: list | None = None):
        """One token per sequence: tokens [B] -> (logits [B, vocab], cache). The cache's states
        and convolution tails are updated in place (``update_cache``): keep a copy of both to
        branch from an earlier point.
        ``fused``: :meth:`input_projections`, one product per layer for its input maps.
        ``tokens`` and ``cache`` are checked as :meth:`forward` checks them."""
        if not torch.compiler.is_compiling() and cache is None:  # forward's refusal would name update_cache
            raise TypeError("cache: expected the list of per-layer dicts that forward returns (a step continues a "
                            "prefill), got NoneType")
        if not torch.compiler.is_compiling() and (not isinstance(tokens, torch.Tensor) or tokens.dim() != 1):
            got = list(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens).__name__
            error = ValueError if isinstance(tokens, torch.Tensor) else TypeError
            raise error(f"tokens: got {got}; allowed: a torch.Tensor [B] of token ids (one per sequence)")
        logits, cache = self.forward(tokens[:, None], cache, backend=backend, update_cache=True, fused=fused)
        return logits[:, 0], cache

    def input_projections(self) -> list[InputProjection]:
        """Every layer's :meth:`RunningTensorLayer.input_projection` (snapshots of the weights)."""
        return [layer.input_projection() for layer in self.mixers]

    def generate(self, tokens: torch.Tensor, max_new_tokens: int, *, temperature: float = 0.0, top_k: int | None = None,
                 seed: int | None = None, cuda_graph: bool | None = None, backend: str = "auto",
                 compile_step: bool = False) -> torch.Tensor:
        """Prefill ``tokens`` [B, T], then decode ``max_new_tokens`` tokens per sequence; returns
        them, [B, max_new_tokens] int64. Greedy at ``temperature`` 0, else sampled (``top_k``,
        ``seed``: the same seed and batch give the same tokens; a row's tokens depend on the
        rows sampled beside it, which draw from the same generator); on CUDA the decode step
        runs as one CUDA graph per batch bucket
        (``cuda_graph`` None: on when the model is on CUDA), fused by torch.compile first with
        ``compile_step``. See :func:`rtcompile.generate.generate`."""
        from .generate import generate

        return generate(self, tokens, max_new_tokens, temperature=temperature, top_k=top_k, seed=seed,
                        cuda_graph=cuda_graph, backend=backend, compile_step=compile_step)
