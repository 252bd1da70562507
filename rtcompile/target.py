"""Target GPU profiles: what the cost model and the planner plan for.

Figures are per GPU, dense (no structured sparsity), from the vendors' public datasheets and
architecture whitepapers; each profile names its source. They are leads: ``auto`` detects the
GPU present and can measure its copy bandwidth and matmul rate (:func:`measure`), which the
planner then prefers. Nothing here imports torch until ``auto`` or ``measure`` is used.
"""

from __future__ import annotations

import json
import math
import re
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from .fields import check_float, check_type
from .fileio import atomic_write, cache_dir

GB = 10**9
TB = 10**12
MiB = 1 << 20
KiB = 1 << 10


@dataclass(frozen=True)
class Target:
    """One GPU. Rates in bytes/s and FLOP/s; sizes in bytes."""

    name: str
    memory_bytes: int
    hbm_bytes_per_s: float
    bf16_flops: float
    fp16_flops: float
    fp32_flops: float
    sms: int
    smem_per_sm: int
    l2_bytes: int
    source: str
    launch_s: float = 4e-6  # one kernel launch under CUDA graphs (DESIGN.md: graphs for small calls)
    measured: bool = False
    wgmma: bool = False  # sm_90's warpgroup MMA: the split form's Gluon state loop runs there

    def __post_init__(self) -> None:
        """Every figure a finite number > 0 (launch_s >= 0): the cost model divides by the rates
        and SM count, and compares against the memory (a custom Target with sms=0 was a
        ZeroDivisionError in make_plan, memory_bytes=nan an empty min()). TypeError for a wrong
        type, ValueError otherwise, each naming the field (fields.check_float's wording)."""
        check_type("target.name", self.name, str, "a string")
        for name in ("memory_bytes", "hbm_bytes_per_s", "bf16_flops", "fp16_flops", "fp32_flops", "sms",
                     "smem_per_sm", "l2_bytes"):
            check_float(f"target.{name}", getattr(self, name), lambda x: x > 0, "a finite number > 0")
        check_float("target.launch_s", self.launch_s, lambda x: x >= 0, "a finite number >= 0")

    def to_dict(self) -> dict:
        return asdict(self)


PROFILES: dict[str, Target] = {
    t.name: t
    for t in (
        Target("h100-sxm", 80 * GB, 3.35 * TB, 989e12, 989e12, 67e12, 132, 228 * KiB, 50 * MiB,
               "NVIDIA H100 Tensor Core GPU datasheet (SXM5), Hopper architecture whitepaper", wgmma=True),
        Target("h200", 141 * GB, 4.8 * TB, 989e12, 989e12, 67e12, 132, 228 * KiB, 60 * MiB,
               "NVIDIA H200 datasheet (SXM); L2 as torch reports it on the device machine (60 MiB); "
               "measured there: copy 4.26 TB/s, bf16 matmul 0.77-0.80 PFLOP/s (DESIGN.md, benchmarks/RESULTS.md)",
               wgmma=True),
        Target("a100-80gb", 80 * GB, 2.039 * TB, 312e12, 312e12, 19.5e12, 108, 164 * KiB, 40 * MiB,
               "NVIDIA A100 datasheet (80GB SXM), Ampere architecture whitepaper"),
        Target("l40s", 48 * GB, 864 * GB, 362e12, 362e12, 91.6e12, 142, 100 * KiB, 96 * MiB,
               "NVIDIA L40S datasheet, Ada Lovelace architecture whitepaper"),
        Target("l4", 24 * GB, 300 * GB, 121e12, 121e12, 30.3e12, 58, 100 * KiB, 48 * MiB,
               "NVIDIA L4 datasheet, Ada Lovelace architecture whitepaper"),
        Target("rtx-4090", 24 * GB, 1008 * GB, 165e12, 165e12, 82.6e12, 128, 100 * KiB, 72 * MiB,
               "NVIDIA Ada Lovelace architecture whitepaper (GeForce RTX 4090; bf16 with fp32 accumulate)"),
        Target("b200", 180 * GB, 8 * TB, 2250e12, 2250e12, 75e12, 148, 228 * KiB, 126 * MiB,
               "NVIDIA HGX B200 datasheet (per GPU); SM count and L2 from Blackwell architecture reports"),
    )
}
DEFAULT_TARGET = "h200"


class TargetError(ValueError):
    """Unknown target name, or no GPU for ``auto``."""


def _cache_file() -> Path:
    return cache_dir() / "targets.json"


def get_target(name: str) -> Target:
    """A profile by name, or ``auto`` for the GPU present (with its measured rates if kept)."""
    if not isinstance(name, str):
        raise TypeError(f"target: expected a name, got {type(name).__name__}")
    key = name.lower()
    if key == "auto":
        return detect()
    if key not in PROFILES:
        raise TargetError(f"target: unknown {name!r}; allowed: auto, {', '.join(PROFILES)}")
    return PROFILES[key]


# The names CUDA gives the boards each profile's figures are: the model token, the tokens such a
# name must hold too, and the ones it may (vendor words are dropped first). Any other token is
# another board: "L40" is not "L4"; "H100 PCIe" (2.0 TB/s) and "H100 NVL" are not the SXM part
# (3.35 TB/s); the A100 40GB (1.56 TB/s) and the 80GB PCIe (1.94) are not the 80GB SXM (2.04).
# Unmatched, a GPU gets the detected target with measured rates (``detect``, ``measure``).
_VENDOR_TOKENS = frozenset({"nvidia", "geforce", "tesla"})
_NAME_TOKENS: dict[str, tuple[str, frozenset[str], frozenset[str]]] = {
    "h200": ("h200", frozenset(), frozenset({"sxm", "sxm5", "141gb", "hbm3e"})),
    "h100-sxm": ("h100", frozenset(), frozenset({"sxm", "sxm5", "80gb", "hbm3"})),
    "a100-80gb": ("a100", frozenset({"80gb"}), frozenset({"sxm", "sxm4"})),
    "l40s": ("l40s", frozenset(), frozenset({"48gb"})),
    "l4": ("l4", frozenset(), frozenset({"24gb"})),
    "rtx-4090": ("4090", frozenset(), frozenset({"rtx", "24gb"})),
    "b200": ("b200", frozenset(), frozenset({"sxm", "sxm6", "180gb", "hbm3e"})),
}


def profile_for(device_name: str) -> Target | None:
    """The datasheet profile whose GPU ``device_name`` (as CUDA reports it) is, or None: the
    name's words (split at spaces, hyphens and underscores) are a profile's model and the
    words such a board's name may add, nothing else."""
    tokens = {t for t in re.split(r"[\s_-]+", device_name.lower()) if t} - _VENDOR_TOKENS
    for prof, (model, required, allowed) in _NAME_TOKENS.items():
        if model in tokens and required <= tokens and tokens <= {model} | required | allowed:
            return PROFILES[prof]
    return None


def detect() -> Target:
    """The profile of the GPU present, with rates measured earlier on it (see :func:`measure`)."""
    import torch

    if not torch.cuda.is_available():
        raise TargetError(f"target: 'auto' needs a CUDA GPU; allowed without one: {', '.join(PROFILES)}")
    dev = torch.cuda.get_device_name(0)
    base = profile_for(dev)
    props = torch.cuda.get_device_properties(0)
    if base is None:
        base = Target(dev, props.total_memory, 1 * TB, 100e12, 100e12, 20e12, props.multi_processor_count,
                      100 * KiB, 40 * MiB, "detected; rates unknown until measured (rtcompile build measures them)",
                      wgmma=props.major == 9)
    kept = _load_measured().get(dev)
    if kept:
        base = replace(base, hbm_bytes_per_s=kept["hbm_bytes_per_s"], bf16_flops=kept["bf16_flops"], measured=True,
                       source=base.source + f"; measured here {kept['date']}")
    return replace(base, memory_bytes=props.total_memory, sms=props.multi_processor_count)


_RATES = ("hbm_bytes_per_s", "bf16_flops")


def _entry_problem(entry) -> str | None:
    """Why a kept measurement is not one (an object with positive finite rates and a date), or None."""
    if not isinstance(entry, dict):
        return f"expected an object, got {type(entry).__name__}"
    for key in _RATES:
        v = entry.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v > 0):
            return f"{key}: got {v!r}; allowed: a finite number > 0"
    if not isinstance(entry.get("date"), str):
        return f"date: got {entry.get('date')!r}; allowed: a date string"
    return None


def _load_measured() -> dict[str, dict]:
    """The kept measurements (GPU name -> its rates and date), those of another shape left out
    with one warning: the file is derived (``measure`` rewrites it), so a damaged one costs a
    measurement, never the command. An absent or unreadable file is none kept."""
    path = _cache_file()
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        bad = [f"expected an object of GPU name -> measurement, got {type(data).__name__}"]
        data = {}
    else:  # each entry judged once: its problem both warns and leaves it out
        problems = {name: _entry_problem(e) for name, e in data.items()}
        bad = [f"{name!r}: {why}" for name, why in problems.items() if why is not None]
        data = {name: e for name, e in data.items() if problems[name] is None}
    if bad:
        more = f" ({len(bad)} in all)" if len(bad) > 1 else ""
        warnings.warn(f"kept GPU measurements {str(path)!r}: {bad[0]}{more}; ignored (measured again by "
                      "`rtcompile build` on that GPU)", RuntimeWarning, stacklevel=3)
    return data


def measure() -> Target:
    """Measure this GPU's copy bandwidth (read + write) and bf16 matmul rate once; keep them."""
    import datetime

    import torch

    from .timing import median_seconds as timed

    def copy_rate(n: int = 1 << 29) -> float:  # 2 GiB of fp32: far beyond L2; freed on return
        src, dst = torch.randn(n, device="cuda"), torch.empty(n, device="cuda")
        return 2 * 4 * n / timed(lambda: dst.copy_(src))

    bw = copy_rate()
    m = 8192
    a, b = torch.randn(m, m, device="cuda", dtype=torch.bfloat16), torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    rate = 2 * m**3 / timed(lambda: a @ b)
    _keep(torch.cuda.get_device_name(0), bw, rate, datetime.date.today().isoformat())
    return detect()


def _keep(device_name: str, hbm_bytes_per_s: float, bf16_flops: float, date: str) -> None:
    """Keep one GPU's measurement beside the others' valid ones: the file rewritten atomically
    (one that held no object of measurements, or malformed ones, is replaced, not refused)."""
    with warnings.catch_warnings():  # this rewrite drops them: the warning would say what is already done
        warnings.simplefilter("ignore", RuntimeWarning)
        data = _load_measured()
    data[device_name] = {"hbm_bytes_per_s": hbm_bytes_per_s, "bf16_flops": bf16_flops, "date": date}
    path = _cache_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(data, indent=1))
