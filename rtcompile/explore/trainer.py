"""Train a RunningTensorLM on MQAR: AdamW, warm-up + cosine, a learning-rate sweep, checkpoints.

:func:`train_recall` draws ``train_examples`` sequences from the run's train seed and
``test_examples`` from its test seed once (:func:`rtcompile.explore.mqar.split_seeds`: disjoint
ranges), then trains one model per learning rate, every one from the same initial weights
(``torch.manual_seed(settings.seed)`` on the CPU before building, so the device does not change
them). A step draws ``batch_size`` train sequences with replacement from a CPU generator seeded
with the train seed (its state is checkpointed, so a resumed run sees the batches an unbroken run
would). The loss is cross entropy at the query positions only; every ``eval_every`` steps (and at
the last step) the query accuracy on the whole test set is measured, and a rate stops early once
it reaches ``target_accuracy``. The result is the best accuracy over the rates and evaluations.

The LM head shares the embedding matrix (``tie_embeddings``, as Zoology's models do): a value
can then be read out as soon as the layers copy its embedding forward, with nothing learned per
token. Untied, the head must learn each value's row from the few queries that answer with it:
at vocabulary 1024 (64 tokens, 8 pairs, d_model 64) the untied loss sat at ln 512 for 2000
steps while the tied model reached 0.99 accuracy by step 1500 (issue 23's MQAR runs). The tied
matrix keeps the embedding's N(0, 1) init although the first loss is then ~18, not ln(vocab):
scaled to std ``model_width ** -0.5`` (unit-scale first logits) the same run stayed at chance
(0.005 after 1500 steps).

AdamW decays only the weight matrices: biases, norm weights (1-D) and the embedding (with the
head tied to it) are left alone (decaying the embedding shrinks the rows of rare tokens, and
MQAR's keys are all rare).

Checkpoints (``checkpoint_dir``): after each evaluation a rate writes ``lr-<rate>.step-<n>.safetensors``
(the model's and the optimizer's tensors and the batch generator's state) and then
``lr-<rate>.json`` (step, history, optimizer scalars and param groups, the scheduler's state,
the tensor file's name and sha256), each atomically (:func:`rtcompile.fileio.atomic_write`). The
JSON is the commit point: a tensor file it does not name is a leftover of a killed run and is
removed. When a rate finishes, its result goes into ``results.json`` (with a fingerprint of the
spec, the task and the settings other than ``learning_rates``) and its checkpoint files are
removed. A call with the same folder reuses the finished rates and resumes an unfinished one from
its last checkpoint, at the same step; a folder written for other settings is refused. Nothing is
ever unpickled: tensors are read with safetensors, the rest is JSON.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from ..fields import check_float, check_int
from ..fileio import atomic_write
from ..functional import BACKENDS
from ..model import RunningTensorLM
from ..spec import ModelSpec
from .mqar import IGNORE, TEST_SEED_OFFSET, MQARTask, make_batch, split_seeds

__all__ = ["RecallResult", "StepHook", "TrainSettings", "train_recall"]

CHECKPOINT_FORMAT = 1
RESULTS_FILE = "results.json"
MAX_STEPS = 10**9
MAX_EXAMPLES = 1 << 26  # 2**26 x 256 int64 tokens is 128 GiB: beyond any device's memory anyway

# Called after every optimizer step with (learning rate, steps done, that step's loss): tests
# count the steps a call really runs and interrupt a run through it.
StepHook = Callable[[float, int, float], None]


@dataclass(frozen=True)
class TrainSettings:
    """How :func:`train_recall` trains (validated on construction)."""

    learning_rates: tuple[float, ...] = (1e-3, 3e-3, 1e-2)
    max_steps: int = 8000  # order 3 at d_model 128 left MQAR's plateau at step ~4000 (RESULTS.md)
    batch_size: int = 64
    train_examples: int = 20000  # drawn once from the train seed
    test_examples: int = 1000  # drawn once from the test seed (a disjoint range)
    weight_decay: float = 0.1
    warmup_fraction: float = 0.1  # linear warm-up over this fraction of max_steps, then cosine to 0
    eval_every: int = 100
    target_accuracy: float = 0.99  # early stop on validation accuracy
    seed: int = 0
    backend: str = "auto"  # RunningTensorLM.forward's backend ("triton" on GPU, "reference" on CPU)
    autocast_bf16: bool = True  # on CUDA only
    mlp: bool = True  # RunningTensorLM's MLP per layer (parameter_count needs the same flag)
    tie_embeddings: bool = True  # the head shares the embedding matrix (see the module docstring)
    # torch.compile backend for the model's forward and backward (None: eager). An experiment:
    # a recall step of the 400 k-parameter MQAR model took ~20 ms on the H200, host-bound by its
    # ~100 small ops per layer and direction; inductor fuses them (untimed on a GPU so far)
    compile_backend: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.learning_rates, list):
            object.__setattr__(self, "learning_rates", tuple(self.learning_rates))
        self.check()

    def check(self) -> None:
        """TypeError for a field of the wrong type, ValueError naming the field and its allowed values."""
        rates = self.learning_rates
        if not isinstance(rates, tuple) or not rates:
            raise TypeError(f"TrainSettings.learning_rates: expected a non-empty tuple of numbers > 0, got {rates!r}")
        for i, lr in enumerate(rates):
            check_float(f"TrainSettings.learning_rates[{i}]", lr, lambda x: 0 < x <= 1, "a finite number in (0, 1]")
        if len({float(lr) for lr in rates}) != len(rates):
            raise ValueError(f"TrainSettings.learning_rates: got {rates}; allowed: distinct rates (each is run once)")
        check_int("TrainSettings.max_steps", self.max_steps, 1, MAX_STEPS)
        check_int("TrainSettings.batch_size", self.batch_size, 1, MAX_EXAMPLES)
        check_int("TrainSettings.train_examples", self.train_examples, 1, MAX_EXAMPLES)
        check_int("TrainSettings.test_examples", self.test_examples, 1, MAX_EXAMPLES)
        check_int("TrainSettings.eval_every", self.eval_every, 1, MAX_STEPS)
        check_int("TrainSettings.seed", self.seed, 0, TEST_SEED_OFFSET - 1)
        check_float("TrainSettings.weight_decay", self.weight_decay, lambda x: x >= 0, "a finite number >= 0")
        check_float("TrainSettings.warmup_fraction", self.warmup_fraction, lambda x: 0 <= x < 1, "a number in [0, 1)")
        check_float("TrainSettings.target_accuracy", self.target_accuracy, lambda x: 0 <= x <= 1, "a number in [0, 1]")
        if not isinstance(self.backend, str) or self.backend not in BACKENDS:
            raise ValueError(f"TrainSettings.backend: got {self.backend!r}; allowed: {', '.join(BACKENDS)}")
        for name in ("autocast_bf16", "mlp", "tie_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"TrainSettings.{name}: expected true or false, got {getattr(self, name)!r}")
        if self.compile_backend is not None:
            if not isinstance(self.compile_backend, str):
                raise TypeError(f"TrainSettings.compile_backend: expected None or a backend name, "
                                f"got {self.compile_backend!r}")
            known = torch.compiler.list_backends(exclude_tags=())
            if self.compile_backend not in known:
                raise ValueError(f"TrainSettings.compile_backend: got {self.compile_backend!r}; allowed: None, "
                                 f"{', '.join(sorted(known))}")

    def to_dict(self) -> dict:
        return {**asdict(self), "learning_rates": [float(lr) for lr in self.learning_rates]}


@dataclass
class RecallResult:
    """What :func:`train_recall` found. ``wall_s``: seconds of the whole sweep, including the
    training time earlier (interrupted) calls recorded in the checkpoint folder."""

    accuracy: float  # best validation accuracy over the learning rates
    learning_rate: float  # the one that reached it (ties: fewer steps, then the smaller rate)
    per_rate: dict[float, float]  # lr -> best validation accuracy
    steps: int  # steps run for the chosen lr
    wall_s: float
    train_seed: int
    test_seed: int
    per_rate_steps: dict[float, int] = field(default_factory=dict)  # lr -> steps run
    # lr -> its evaluations in order, {"step", "accuracy", "loss"} (the loss: mean since the last)
    per_rate_history: dict[float, list] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"accuracy": self.accuracy, "learning_rate": self.learning_rate,
                "per_rate": {repr(float(lr)): a for lr, a in self.per_rate.items()},
                "per_rate_steps": {repr(float(lr)): s for lr, s in self.per_rate_steps.items()},
                "per_rate_history": {repr(float(lr)): h for lr, h in self.per_rate_history.items()},
                "steps": self.steps, "wall_s": self.wall_s, "train_seed": self.train_seed, "test_seed": self.test_seed}


# ----- checkpoint files -----------------------------------------------------------------------

def _rate_name(lr: float) -> str:
    return f"lr-{float(lr)!r}"


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:  # ValueError: a decode error, or a number past 4300 digits
        raise ValueError(f"checkpoint_dir: {str(path)!r} cannot be read as JSON ({exc}); allowed: a folder "
                         "written by train_recall (remove the file to start that part again)") from None
    if not isinstance(data, dict) or data.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"checkpoint_dir: {str(path)!r} is not a format-{CHECKPOINT_FORMAT} train_recall file")
    return data


def _write_json(path: Path, data: dict) -> None:
    atomic_write(path, json.dumps(data, indent=1, sort_keys=True) + "\n")


def _fingerprint(spec: ModelSpec, task: MQARTask, settings: TrainSettings) -> dict:
    rest = {k: v for k, v in settings.to_dict().items() if k != "learning_rates"}
    return json.loads(json.dumps({"spec": spec.to_dict(), "task": task.to_dict(), "settings": rest}))


def _check_fingerprint(path: Path, data: dict, want: dict) -> None:
    have = data.get("fingerprint")
    if have == want:
        return
    have = have if isinstance(have, dict) else {}
    diff = sorted(f"{part}.{k}" for part in want for k in set(want[part]) | set(have.get(part) or {})
                  if (have.get(part) or {}).get(k) != want[part].get(k))
    raise ValueError(f"checkpoint_dir: {str(path)!r} was written for other settings (differing: {', '.join(diff) or 'format'}); "
                     "allowed: the same spec, task and settings (learning_rates may change), or another folder")


def _flatten_optimizer(state: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """An optimizer state dict as tensors (``optimizer.<param>.<name>``) and JSON (the rest)."""
    tensors, scalars = {}, {}
    for idx, entry in state["state"].items():
        for name, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optimizer.{idx}.{name}"] = value.detach().contiguous()
            else:
                scalars.setdefault(str(idx), {})[name] = value
    return tensors, {"param_groups": state["param_groups"], "scalars": scalars}


def _unflatten_optimizer(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    state: dict[int, dict] = {}
    for key, value in tensors.items():
        if key.startswith("optimizer."):
            _, idx, name = key.split(".", 2)
            state.setdefault(int(idx), {})[name] = value
    for idx, entry in meta["scalars"].items():
        state.setdefault(int(idx), {}).update(entry)
    return {"state": state, "param_groups": meta["param_groups"]}


# ----- one learning rate ----------------------------------------------------------------------

class _Rate:
    """The model, optimizer, schedule and batch generator of one learning rate."""

    def __init__(self, spec: ModelSpec, task: MQARTask, settings: TrainSettings, lr: float, device: torch.device,
                 train_seed: int):
        self.lr, self.settings = float(lr), settings
        with torch.random.fork_rng(devices=[]), torch.device("cpu"):
            torch.manual_seed(settings.seed)  # the same initial weights for every rate and device
            model = RunningTensorLM(spec, vocab_size=task.vocab_size, mlp=settings.mlp,
                                    tie_embeddings=settings.tie_embeddings)
        self.model = model.to(device)
        # the compiled module shares the model's parameters; checkpoints read self.model
        self.forward = self.model if settings.compile_backend is None else \
            torch.compile(self.model, backend=settings.compile_backend, fullgraph=True)
        decay, keep = [], []
        for name, p in self.model.named_parameters():
            (keep if p.dim() < 2 or name.startswith("embed.") else decay).append(p)
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": settings.weight_decay},
                                      {"params": keep, "weight_decay": 0.0}], lr=self.lr)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, self._factor)
        self.batches = torch.Generator().manual_seed(train_seed)
        self.step, self.best, self.history, self.wall_s = 0, 0.0, [], 0.0

    def _factor(self, step: int) -> float:
        """LR multiplier after ``step`` optimizer steps: linear warm-up, then cosine to 0 at max_steps."""
        total = self.settings.max_steps
        warm = round(self.settings.warmup_fraction * total)
        if step < warm:
            return (step + 1) / warm
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, (step - warm) / max(1, total - warm))))

    @property
    def done(self) -> bool:
        s = self.settings
        return self.step >= s.max_steps or (bool(self.history) and self.best >= s.target_accuracy)

    # -- checkpoints --
    def save(self, folder: Path, fingerprint: dict) -> None:
        from safetensors.torch import save

        tensors = {f"model.{k}": v.detach().contiguous() for k, v in self.model.state_dict().items()
                   if not (self.settings.tie_embeddings and k == "head.weight")}  # safetensors refuses shared tensors
        opt_tensors, opt_meta = _flatten_optimizer(self.opt.state_dict())
        tensors.update(opt_tensors)
        tensors["rng.batches"] = self.batches.get_state()
        blob = save({k: v.cpu() for k, v in tensors.items()})
        name = f"{_rate_name(self.lr)}.step-{self.step}.safetensors"
        atomic_write(folder / name, blob)
        _write_json(folder / f"{_rate_name(self.lr)}.json", {
            "format": CHECKPOINT_FORMAT, "fingerprint": fingerprint, "learning_rate": self.lr, "step": self.step,
            "best_accuracy": self.best, "history": self.history, "wall_s": self.wall_s, "tensors": name,
            "sha256": hashlib.sha256(blob).hexdigest(), "optimizer": opt_meta, "scheduler": self.sched.state_dict()})
        _remove_stale(folder, self.lr, keep=name)

    def load(self, folder: Path, fingerprint: dict) -> bool:
        """Restore the last checkpoint of this rate; False when there is none."""
        from safetensors.torch import load

        path = folder / f"{_rate_name(self.lr)}.json"
        if not path.exists():
            return False
        meta = _read_json(path)
        _check_fingerprint(path, meta, fingerprint)
        blob_path = folder / str(meta.get("tensors"))
        try:
            blob = blob_path.read_bytes()
        except OSError as exc:
            raise ValueError(f"checkpoint_dir: {str(blob_path)!r}, named by {str(path)!r}, cannot be read ({exc})") from None
        if hashlib.sha256(blob).hexdigest() != meta.get("sha256") or meta.get("learning_rate") != self.lr:
            raise ValueError(f"checkpoint_dir: {str(blob_path)!r} does not match {str(path)!r} (sha256 or learning "
                             "rate differ); remove both to restart this learning rate")
        tensors = load(blob)
        model_state = {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}
        if self.settings.tie_embeddings and "embed.weight" in model_state:
            model_state["head.weight"] = model_state["embed.weight"]
        try:
            self.model.load_state_dict(model_state, strict=True)
            self.opt.load_state_dict(_unflatten_optimizer(tensors, meta["optimizer"]))
        except (RuntimeError, KeyError, ValueError, TypeError) as exc:
            raise ValueError(f"checkpoint_dir: {str(blob_path)!r} does not fit this model ({exc})") from None
        try:  # the JSON's own fields (its tensors are hashed, it is not): a KeyError before
            self.sched.load_state_dict(meta["scheduler"])
            self.batches.set_state(tensors["rng.batches"])
            self.step, self.best = int(meta["step"]), float(meta["best_accuracy"])
            self.history, self.wall_s = list(meta["history"]), float(meta["wall_s"])
        except (RuntimeError, KeyError, ValueError, TypeError) as exc:
            raise ValueError(f"checkpoint_dir: {str(path)!r} is damaged ({type(exc).__name__}: {exc}); remove it "
                             "and its tensors to restart this learning rate") from None
        return True

    # -- training --
    def autocast(self, device: torch.device):
        if device.type == "cuda" and self.settings.autocast_bf16:
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def train_step(self, inputs: torch.Tensor, labels: torch.Tensor, device: torch.device) -> torch.Tensor:
        idx = torch.randint(0, inputs.shape[0], (self.settings.batch_size,), generator=self.batches)
        if device.type == "cuda":
            # a blocking copy from pageable memory waits for the stream: every step would wait for
            # the previous one and the host could never queue ahead (not yet timed on a GPU)
            idx = idx.pin_memory().to(device, non_blocking=True)
        else:
            idx = idx.to(device)
        self.model.train()
        with self.autocast(device):
            logits, _ = self.forward(inputs[idx], backend=self.settings.backend)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels[idx].reshape(-1),
                               ignore_index=IGNORE)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        self.sched.step()
        self.step += 1
        return loss.detach()

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor, labels: torch.Tensor, device: torch.device) -> float:
        """Query accuracy over the whole test set, in batches of batch_size (the logits of a batch
        are B x T x V; training already holds that much)."""
        self.model.eval()
        # counted on the device, read once: a read per batch would sync the GPU per test batch
        hits = torch.zeros((), dtype=torch.int64, device=inputs.device)
        for start in range(0, inputs.shape[0], self.settings.batch_size):
            x, y = inputs[start:start + self.settings.batch_size], labels[start:start + self.settings.batch_size]
            with self.autocast(device):
                logits, _ = self.forward(x, backend=self.settings.backend)
            hits += ((logits.argmax(dim=-1) == y) & (y != IGNORE)).sum()
        return int(hits) / int((labels != IGNORE).sum())


def _remove_stale(folder: Path, lr: float, keep: str | None) -> None:
    for path in folder.glob(f"{_rate_name(lr)}.step-*.safetensors"):
        if path.name != keep:
            path.unlink(missing_ok=True)


def _progress(enabled: bool):
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                    TimeElapsedColumn(), console=console, disable=not (enabled and console.is_terminal))


def _run_rate(rate: _Rate, data, device, folder: Path | None, fingerprint: dict, bar, on_step: StepHook | None) -> None:
    train_x, train_y, test_x, test_y = data
    s = rate.settings
    task = bar.add_task(f"lr {rate.lr:g}", total=s.max_steps, completed=rate.step,
                        info=f"acc {rate.best:.3f}" if rate.history else "")
    started, loss_sum, loss_n = time.perf_counter() - rate.wall_s, None, 0
    while not rate.done:
        loss = rate.train_step(train_x, train_y, device)
        loss_sum, loss_n = (loss if loss_sum is None else loss_sum + loss), loss_n + 1
        if on_step is not None:
            on_step(rate.lr, rate.step, float(loss))
        bar.update(task, advance=1)
        if rate.step % s.eval_every == 0 or rate.step == s.max_steps:
            acc = rate.evaluate(test_x, test_y, device)
            rate.best = max(rate.best, acc)
            rate.history.append({"step": rate.step, "accuracy": acc, "loss": float(loss_sum) / loss_n})
            loss_sum, loss_n = None, 0
            rate.wall_s = time.perf_counter() - started
            bar.update(task, info=f"acc {acc:.3f} (best {rate.best:.3f}) loss {rate.history[-1]['loss']:.3f}")
            if folder is not None:
                rate.save(folder, fingerprint)
    bar.update(task, completed=rate.step)


def _check_call(spec, task, settings, device, checkpoint_dir, progress, on_step) -> tuple[torch.device, Path | None]:
    for name, value, kind in (("spec", spec, ModelSpec), ("task", task, MQARTask), ("settings", settings, TrainSettings)):
        if not isinstance(value, kind):
            raise TypeError(f"{name}: expected a {kind.__name__}, got {type(value).__name__}")
    task.check()
    settings.check()
    if not isinstance(progress, bool):
        raise TypeError(f"progress: expected true or false, got {progress!r}")
    if on_step is not None and not callable(on_step):
        raise TypeError(f"on_step: expected a callable or None, got {type(on_step).__name__}")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device: got {device!r}; allowed: a torch device such as 'cpu' or 'cuda:0' ({exc})") from None
    if checkpoint_dir is None:
        return dev, None
    if not isinstance(checkpoint_dir, (str, Path)):
        raise TypeError(f"checkpoint_dir: expected a path or None, got {type(checkpoint_dir).__name__}")
    folder = Path(checkpoint_dir)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"checkpoint_dir: {str(folder)!r} exists and is not a folder; allowed: a folder or a new path")
    folder.mkdir(parents=True, exist_ok=True)
    return dev, folder


def train_recall(spec: ModelSpec, task: MQARTask, settings: TrainSettings, *, device: str | torch.device = "cpu",
                 checkpoint_dir: str | Path | None = None, progress: bool = True,
                 on_step: StepHook | None = None) -> RecallResult:
    """Train ``RunningTensorLM(spec, vocab_size=task.vocab_size)`` on MQAR at each of
    ``settings.learning_rates`` and return the best (see the module docstring). ``checkpoint_dir``
    makes the sweep resumable; ``progress`` shows rich progress bars on a terminal (stderr);
    ``on_step`` (:data:`StepHook`) is called after every optimizer step."""
    dev, folder = _check_call(spec, task, settings, device, checkpoint_dir, progress, on_step)
    began = time.perf_counter()
    train_seed, test_seed = split_seeds(settings.seed)
    fingerprint = _fingerprint(spec, task, settings)
    finished: dict[str, dict] = {}
    if folder is not None and (folder / RESULTS_FILE).exists():
        stored = _read_json(folder / RESULTS_FILE)
        _check_fingerprint(folder / RESULTS_FILE, stored, fingerprint)
        finished = dict(stored.get("rates") or {})
    earlier = sum(float(r["wall_s"]) for lr, r in finished.items()
                  if float(lr) in {float(x) for x in settings.learning_rates})
    data = (*make_batch(task, settings.train_examples, train_seed, dev), *make_batch(task, settings.test_examples, test_seed, dev))
    results: dict[float, dict] = {}
    with _progress(progress) as bar:
        for lr in settings.learning_rates:
            key = repr(float(lr))
            if key in finished:
                results[float(lr)] = finished[key]
                continue
            rate = _Rate(spec, task, settings, lr, dev, train_seed)
            if folder is not None and rate.load(folder, fingerprint):
                earlier += rate.wall_s
            _run_rate(rate, data, dev, folder, fingerprint, bar, on_step)
            results[float(lr)] = {"accuracy": rate.best, "steps": rate.step, "wall_s": rate.wall_s, "history": rate.history}
            if folder is not None:
                finished[key] = results[float(lr)]
                _write_json(folder / RESULTS_FILE, {"format": CHECKPOINT_FORMAT, "fingerprint": fingerprint, "rates": finished})
                (folder / f"{_rate_name(lr)}.json").unlink(missing_ok=True)
                _remove_stale(folder, lr, keep=None)
    best = max(results, key=lambda lr: (results[lr]["accuracy"], -results[lr]["steps"], -lr))
    return RecallResult(accuracy=float(results[best]["accuracy"]), learning_rate=best,
                        per_rate={lr: float(r["accuracy"]) for lr, r in results.items()}, steps=int(results[best]["steps"]),
                        wall_s=earlier + time.perf_counter() - began, train_seed=train_seed, test_seed=test_seed,
                        per_rate_steps={lr: int(r["steps"]) for lr, r in results.items()},
                        per_rate_history={lr: list(r.get("history") or []) for lr, r in results.items()})
