"""``rtcompile bench``: one-run measurements of our kernels against the reference and fla.

One invocation on one CUDA GPU measures, in this order, and writes every number as a row:

1. ceilings: device-to-device copy bandwidth (``dst.copy_(src)`` of 2 GiB, bytes = read +
   write) and the bf16 matmul rate (8192^3);
2. prefill (chunk forward over T tokens from a zero state) of our Triton kernel, the PyTorch
   reference and flash-linear-attention's ``chunk_gated_delta_rule`` on explicitly
   materialised Kronecker keys (only where K <= 256; fla-core 0.6.0 refuses larger K);
3. the error of each prefill implementation against the float64 token loop at a small T;
4. decode (one token per sequence, state cache updated in place) of our kernel, the reference
   and fla's ``fused_recurrent_gated_delta_rule``, against a large copy and against a copy of
   exactly the state bytes; then the eager Python overhead per decode call;
5. train (``--phase train`` only, :mod:`.train`): forward + backward of our Triton kernels, the
   reference's autograd and fla's on materialised keys, the forward alone, peak extra memory.

``--model SPEC`` (:mod:`.lm`, imported only then) measures the whole model of a spec instead:
prefill and CUDA-graph decode tokens/s, ours beside fla's mixer where K <= 256.

Invariants that keep the numbers honest:

* all implementations of a case see the same inputs (same seeds on the same device);
* bytes and FLOPs are the factored problem's (:mod:`rtcompile.figures`) for every
  implementation, so GB/s and TFLOP/s compare speed; fla's extra traffic from materialised
  Kronecker keys is never credited;
* warm-up (compile, autotune) is never timed; a time is the median of repeats measured with
  CUDA events; calls under ``GRAPH_BELOW_S`` are captured in a CUDA graph (many calls per
  graph) and the replay time divided by the number of calls;
* consecutive timed calls rotate over input sets / state-cache slots whose total footprint is
  at least ``L2_ROTATE_FACTOR`` x L2, so no call reads what the previous one left in L2;
* one failing implementation (exception, OOM, refusal) yields a row with a note and the run goes
  on; results are rewritten atomically after every case, so a killed run keeps what it measured.

Nothing here touches a device at import time: torch, the kernels and fla are imported inside
the functions that need them (``--dry-run`` and the arithmetic run without CUDA).
"""

from .core import *  # noqa: F403
from .measure import *  # noqa: F403
from .report import *  # noqa: F403
