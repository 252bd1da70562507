"""What a tuning study is about: the kernel, the shape bucket and the machine.

One Optuna study per (kernel, kernel source hash, shape bucket, dtype, GPU name and compute
capability, Triton version, package version). Shape buckets round B and T up to powers of two,
so a tuned entry serves every nearby exact shape.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from ..kernels.config import next_pow2

KERNELS = ("chunk", "recurrent", "chunk_bwd")  # chunk_bwd: the train bucket (forward + backward)
DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class Bucket:
    """One shape bucket of one kernel: B and T are powers of two (decode: T = 1)."""

    kernel: str
    key_widths: tuple[int, ...]
    value_width: int
    heads: int
    batch: int
    seq_len: int
    dtype: str

    def __post_init__(self) -> None:
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel: got {self.kernel!r}; allowed: {', '.join(KERNELS)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: got {self.dtype!r}; allowed: {', '.join(DTYPES)}")
        object.__setattr__(self, "key_widths", tuple(self.key_widths))
        object.__setattr__(self, "batch", next_pow2(self.batch))
        object.__setattr__(self, "seq_len", 1 if self.kernel == "recurrent" else next_pow2(self.seq_len))

    @property
    def label(self) -> str:
        w = "x".join(map(str, self.key_widths))
        return f"{self.kernel} o{len(self.key_widths) + 1} {w} V{self.value_width} H{self.heads} B{self.batch} T{self.seq_len} {self.dtype}"


@dataclass(frozen=True)
class Machine:
    """Where timings were taken; a study's results are only valid there."""

    gpu: str
    capability: str
    triton: str
    package: str

    @classmethod
    def current(cls, device: str) -> "Machine":
        import torch
        import triton

        from .._version import __version__
        from ..kernels.launch import device_name

        dev = torch.device(device)
        if dev.type == "cuda":
            cc = ".".join(map(str, torch.cuda.get_device_capability(dev)))
        else:
            cc = "cpu"
        return cls(device_name(dev), cc, triton.__version__, __version__)


def study_name(bucket: Bucket, machine: Machine, source: str) -> str:
    """A stable, readable study name carrying every part of the study key."""
    # off the GPU the capability is "cpu" and the name says so already ("cpu-interpreter")
    where = machine.gpu if machine.capability == "cpu" else f"{machine.gpu} cc{machine.capability}"
    return f"rtcompile:{bucket.label}:src {source}:{where}:triton {machine.triton}:rtcompile {machine.package}"


def key_attrs(bucket: Bucket, machine: Machine, source: str) -> dict[str, str]:
    """The study key as user attributes (JSON values), for --list and the dashboard."""
    return {"bucket": json.dumps(asdict(bucket)), "machine": json.dumps(asdict(machine)), "source": source}
