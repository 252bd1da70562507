"""Multi-query associative recall (MQAR): the recall task of the order / width explorer.

Written from the public description of the task in the Zoology project (Arora et al., 2023),
not from its code. A sequence of ``seq_len`` tokens holds ``num_kv_pairs`` key-value pairs at
its start (``k1 v1 k2 v2 ...``); later every key appears once more (a query) followed by its
value, and the model is scored on predicting that value the moment it has read the queried key.

Vocabulary (``V = vocab_size``): token ``FILLER`` (0) fills every position that is neither
context nor a query; keys are tokens ``1 .. 1 + nk - 1`` with ``nk = (V - 1) // 2``; values are
the remaining ``V - 1 - nk`` tokens. Keys are distinct within a sequence (a repeated key would
have two values); values are distinct too, so a value names its key as well. Zoology fills the
gaps with zeros or with random tokens; we use one dedicated filler token, so that a query is the
only key token after the context and the score measures recall, not telling filler from queries.

Query placement: after the context (``2 N`` tokens) the rest of the sequence is cut into
``S = (seq_len - 2 N) // 2`` slots of two tokens (query key, then its value; an odd last token is
filler). Slot ``j`` (0-based) lies at gap ``g = j + 1`` slots from the context's end, and
carries weight ``g ** (alpha - 1)``: the density ``alpha * x ** (alpha - 1)`` of Zoology's
power-law parameter, so ``alpha`` 1 is uniform and the default 0.01 makes near queries ~1/g more
likely than far ones. ``N`` slots are drawn per sequence without replacement with probability
proportional to their weights (successive sampling, :func:`torch.multinomial`), and the keys are
assigned to them in a random order (assigning the first key to the first draw would tie a key's
context position to its gap).

Inputs and labels are aligned: ``labels[p]`` is the token the model must emit after reading
``inputs[p]``; it is the value at a query position and -100 (ignored) everywhere else.

Seeds: a batch is a function of ``(task, num_examples, seed, device type)``; one
:class:`torch.Generator` seeded with ``seed`` draws it, in fixed-size chunks of examples (the
distinct-token draw needs ``chunk x nk`` random numbers; :data:`DRAW_ELEMENTS` bounds them).
Train and test sets come from disjoint seed ranges: :func:`split_seeds` maps a run seed ``s`` in
``[0, TEST_SEED_OFFSET)`` to train seed ``s`` and test seed ``TEST_SEED_OFFSET + s``, so no test
seed is ever a train seed of any run.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from ..fields import check_float, check_int

__all__ = ["FILLER", "IGNORE", "MQARTask", "TEST_SEED_OFFSET", "make_batch", "query_accuracy", "query_gaps",
           "slot_weights", "split_seeds"]

FILLER = 0  # the token at every position that is neither context nor a query
IGNORE = -100  # the label of unscored positions (torch's cross_entropy ignore_index default)
# Train seeds live in [0, 2**62), test seeds in [2**62, 2**63): torch.Generator.manual_seed takes
# up to 2**64 - 1, and 2**62 leaves every practical run seed on the train side.
TEST_SEED_OFFSET = 1 << 62
# At most 2**24 random numbers (64 MiB of fp32) per distinct-token draw: the default task
# (nk = 4095 keys) then draws 4096 examples at a time, 20000 train examples in 5 chunks.
DRAW_ELEMENTS = 1 << 24
MAX_VOCAB = 1 << 24  # token ids far beyond any embedding table this explorer trains
MAX_SEQ_LEN = 1 << 20


@dataclass(frozen=True)
class MQARTask:
    """One MQAR configuration (validated on construction; see the module docstring)."""

    vocab_size: int = 8192
    seq_len: int = 256
    num_kv_pairs: int = 16
    alpha: float = 0.01  # power-law exponent of the query gaps (Zoology's power_a)

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """TypeError for a field of the wrong type, ValueError naming the field and its allowed
        values for one out of range (the pairs must fit the vocabulary and the sequence)."""
        for name, lo, hi in (("vocab_size", 3, MAX_VOCAB), ("seq_len", 4, MAX_SEQ_LEN), ("num_kv_pairs", 1, MAX_SEQ_LEN)):
            check_int(f"MQARTask.{name}", getattr(self, name), lo, hi)
        check_float("MQARTask.alpha", self.alpha, lambda x: x > 0, "a finite number > 0 (1 = uniform gaps)")
        n = self.num_kv_pairs
        if self.num_keys < n or self.num_values < n:
            raise ValueError(f"MQARTask.vocab_size: got {self.vocab_size} for {n} key-value pairs; allowed: at least "
                             f"2 * num_kv_pairs + 1 = {2 * n + 1} ({n} distinct keys, {n} distinct values, the filler)")
        if self.seq_len < 4 * n:
            raise ValueError(f"MQARTask.seq_len: got {self.seq_len} for {n} key-value pairs; allowed: at least "
                             f"4 * num_kv_pairs = {4 * n} (2 N context tokens and N two-token query slots)")

    @property
    def num_keys(self) -> int:
        return (self.vocab_size - 1) // 2

    @property
    def num_values(self) -> int:
        return self.vocab_size - 1 - self.num_keys

    @property
    def num_slots(self) -> int:
        """Two-token query slots after the context."""
        return (self.seq_len - 2 * self.num_kv_pairs) // 2

    def to_dict(self) -> dict:
        return asdict(self)


def slot_weights(task: MQARTask, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Unnormalised weights [num_slots] of the query slots: gap ``g = j + 1`` slots -> ``g ** (alpha - 1)``."""
    gaps = torch.arange(1, task.num_slots + 1, dtype=torch.float64)
    return gaps.pow(float(task.alpha) - 1).to(dtype)


def split_seeds(seed: int) -> tuple[int, int]:
    """(train seed, test seed) of run seed ``seed``: disjoint ranges, see the module docstring."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed: expected an integer in [0, {TEST_SEED_OFFSET}), got {type(seed).__name__} {seed!r}")
    if not 0 <= seed < TEST_SEED_OFFSET:
        raise ValueError(f"seed: got {seed}; allowed: an integer in [0, 2**62)")
    train, test = seed, TEST_SEED_OFFSET + seed
    assert train < TEST_SEED_OFFSET <= test < 2 * TEST_SEED_OFFSET  # the two ranges never meet
    return train, test


def _distinct(gen: torch.Generator, rows: int, pool: int, take: int, device) -> torch.Tensor:
    """[rows, take] distinct ids in [0, pool) per row, uniformly random subsets in random order
    (the top ``take`` of ``pool`` i.i.d. uniforms)."""
    return torch.rand(rows, pool, generator=gen, device=device).topk(take, dim=1).indices


def _chunk(task: MQARTask, rows: int, gen: torch.Generator, weights: torch.Tensor, device):
    n = task.num_kv_pairs
    keys = 1 + _distinct(gen, rows, task.num_keys, n, device)
    values = 1 + task.num_keys + _distinct(gen, rows, task.num_values, n, device)
    slots = torch.multinomial(weights.expand(rows, -1).contiguous(), n, replacement=False, generator=gen)  # [rows, n]
    # slots[:, i] is queried with key order[:, i], a random permutation per row
    order = torch.rand(rows, n, generator=gen, device=device).argsort(dim=1)
    inputs = torch.full((rows, task.seq_len), FILLER, dtype=torch.int64, device=device)
    labels = torch.full_like(inputs, IGNORE)
    inputs[:, 0:2 * n:2] = keys
    inputs[:, 1:2 * n:2] = values
    pos = 2 * n + 2 * slots
    inputs.scatter_(1, pos, keys.gather(1, order))
    inputs.scatter_(1, pos + 1, values.gather(1, order))
    labels.scatter_(1, pos, values.gather(1, order))
    return inputs, labels


def make_batch(task: MQARTask, num_examples: int, seed: int, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """``num_examples`` MQAR sequences drawn on ``device`` from ``seed``: (inputs, labels), both
    [num_examples, seq_len] int64; labels are -100 except at the query positions (the value)."""
    if not isinstance(task, MQARTask):
        raise TypeError(f"task: expected an MQARTask, got {type(task).__name__}")
    if isinstance(num_examples, bool) or not isinstance(num_examples, int):
        raise TypeError(f"num_examples: expected an integer >= 1, got {type(num_examples).__name__} {num_examples!r}")
    if num_examples < 1:
        raise ValueError(f"num_examples: got {num_examples}; allowed: an integer >= 1")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed: expected an integer in [0, 2**63), got {type(seed).__name__} {seed!r}")
    if not 0 <= seed < 2 * TEST_SEED_OFFSET:
        raise ValueError(f"seed: got {seed}; allowed: an integer in [0, 2**63)")
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    weights = slot_weights(task, torch.float32).to(device)
    rows = max(1, DRAW_ELEMENTS // max(task.num_keys, task.num_values))
    parts = [_chunk(task, min(rows, num_examples - start), gen, weights, device)
             for start in range(0, num_examples, rows)]  # a loop over chunks of examples, not over examples
    if len(parts) == 1:
        return parts[0]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def query_gaps(task: MQARTask, labels: torch.Tensor) -> torch.Tensor:
    """[num_examples, num_kv_pairs] gaps (in slots, 1-based) of each sequence's queries, in position
    order: what the power law governs (the tests check it)."""
    pos = (labels != IGNORE).nonzero()[:, 1].reshape(labels.shape[0], task.num_kv_pairs)
    return (pos - 2 * task.num_kv_pairs) // 2 + 1


def query_accuracy(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Fraction of the scored positions (label != -100) whose argmax over the last axis of
    ``logits`` [..., vocab] equals the label [...]; ValueError when nothing is scored."""
    if not isinstance(logits, torch.Tensor) or not isinstance(labels, torch.Tensor):
        raise TypeError(f"logits, labels: expected tensors, got {type(logits).__name__}, {type(labels).__name__}")
    if logits.dim() < 1 or tuple(logits.shape[:-1]) != tuple(labels.shape):
        raise ValueError(f"logits: shape {tuple(logits.shape)} does not match labels {tuple(labels.shape)}; "
                         "allowed: labels' shape plus a trailing vocabulary axis")
    mask = labels != IGNORE
    total = int(mask.sum())
    if total == 0:
        raise ValueError("labels: no position is scored (every label is -100); allowed: at least one query label")
    hits = (logits.argmax(dim=-1) == labels) & mask
    return int(hits.sum()) / total
