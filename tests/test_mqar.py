"""The MQAR generator's invariants (rtcompile.explore.mqar): distinct keys, every key queried once
with its value as the label, labels only at the queries, the power-law gaps (a chi-square test
against the exact distribution of successive weighted sampling, which also rejects a wrong
alpha), disjoint train / test seeds, determinism, and the field checks."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from rtcompile.explore.mqar import (FILLER, IGNORE, TEST_SEED_OFFSET, MQARTask, make_batch, query_accuracy,
                                    query_gaps, slot_weights, split_seeds)

TASK = MQARTask(vocab_size=64, seq_len=48, num_kv_pairs=6, alpha=0.01)


def _context(task, inputs):
    n = task.num_kv_pairs
    return inputs[:, 0:2 * n:2], inputs[:, 1:2 * n:2]


def test_keys_are_distinct_and_from_their_half_of_the_vocabulary():
    inputs, _ = make_batch(TASK, 2000, seed=3)
    keys, values = _context(TASK, inputs)
    assert (keys.sort(dim=1).values.diff(dim=1) > 0).all()  # distinct within each sequence
    assert (values.sort(dim=1).values.diff(dim=1) > 0).all()
    assert keys.min() >= 1 and keys.max() <= TASK.num_keys
    assert values.min() > TASK.num_keys and values.max() < TASK.vocab_size
    # the draw covers the key half (a generator stuck on a few ids would pass the checks above)
    assert keys.unique().numel() == TASK.num_keys


def test_every_key_is_queried_once_and_labelled_with_its_value():
    inputs, labels = make_batch(TASK, 500, seed=4)
    keys, values = _context(TASK, inputs)
    scored = labels != IGNORE
    assert (scored.sum(dim=1) == TASK.num_kv_pairs).all()
    rows, pos = scored.nonzero(as_tuple=True)
    queried = inputs[rows, pos].reshape(-1, TASK.num_kv_pairs)
    assert torch.equal(queried.sort(dim=1).values, keys.sort(dim=1).values)  # each key exactly once
    # the label is the value paired with the queried key in the context, and the next input
    where = (keys[rows] == inputs[rows, pos][:, None]).float().argmax(dim=1)
    assert torch.equal(labels[rows, pos], values[rows, where])
    assert torch.equal(inputs[rows, pos + 1], labels[rows, pos])


def test_labels_only_at_query_positions_and_filler_elsewhere():
    inputs, labels = make_batch(TASK, 500, seed=5)
    n = 2 * TASK.num_kv_pairs
    assert (labels[:, :n] == IGNORE).all()  # the context is never scored
    rows, pos = (labels != IGNORE).nonzero(as_tuple=True)
    assert ((pos - n) % 2 == 0).all()  # a query starts a two-token slot
    used = torch.zeros_like(labels, dtype=torch.bool)
    used[:, :n] = True
    used[rows, pos] = True
    used[rows, pos + 1] = True
    assert (inputs[~used] == FILLER).all()
    assert ((labels[~used] == IGNORE)).all()
    assert (inputs[used] != FILLER).all()


def _set_probabilities(weights: list[float], take: int) -> dict[tuple[int, ...], float]:
    """Exact probability of each unordered set of ``take`` slots under successive sampling without
    replacement with probability proportional to ``weights`` (what torch.multinomial does)."""
    total = sum(weights)
    out: dict[tuple[int, ...], float] = {}
    for perm in itertools.permutations(range(len(weights)), take):
        p, left = 1.0, total
        for j in perm:
            p *= weights[j] / left
            left -= weights[j]
        key = tuple(sorted(perm))
        out[key] = out.get(key, 0.0) + p
    return out


def _chi_square_p(observed: dict, expected: dict, samples: int) -> float:
    stat = sum((observed.get(k, 0) - samples * p) ** 2 / (samples * p) for k, p in expected.items())
    dof = len(expected) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                        torch.tensor(stat / 2, dtype=torch.float64)))


# 8 slots, 3 pairs: 56 possible gap sets. 40000 sequences put 43.6 expected in the rarest set
# (checked below), enough for the chi-square approximation (the rule of thumb asks 5).
GAP_TASK = MQARTask(vocab_size=16, seq_len=2 * 3 + 2 * 8, num_kv_pairs=3, alpha=0.01)
GAP_SAMPLES = 40000


def _gap_sets(task):
    _, labels = make_batch(task, GAP_SAMPLES, seed=11)
    counts: dict[tuple[int, ...], int] = {}
    for row in (query_gaps(task, labels) - 1).tolist():
        key = tuple(row)
        counts[key] = counts.get(key, 0) + 1
    return counts


def test_gap_sets_follow_the_power_law_and_a_wrong_alpha_is_rejected():
    assert GAP_TASK.num_slots == 8
    counts = _gap_sets(GAP_TASK)
    expected = _set_probabilities(slot_weights(GAP_TASK).tolist(), GAP_TASK.num_kv_pairs)
    assert len(expected) == math.comb(8, 3) and min(expected.values()) * GAP_SAMPLES >= 40
    assert set(counts) <= set(expected)
    assert _chi_square_p(counts, expected, GAP_SAMPLES) > 1e-3
    for wrong in (0.1, 0.5, 1.0):  # 1.0: uniform gaps; 0.1 and 0.5: milder power laws (p 1e-59 at 0.1)
        other = _set_probabilities(slot_weights(MQARTask(**{**GAP_TASK.to_dict(), "alpha": wrong})).tolist(), 3)
        assert _chi_square_p(counts, other, GAP_SAMPLES) < 1e-6, wrong


def test_single_query_gap_is_the_normalised_power_law():
    task = MQARTask(vocab_size=8, seq_len=2 + 2 * 30, num_kv_pairs=1, alpha=0.3)
    samples = 30000
    _, labels = make_batch(task, samples, seed=12)
    gaps = query_gaps(task, labels)[:, 0]
    observed = {(g,): int(c) for g, c in zip(*gaps.unique(return_counts=True))}
    w = slot_weights(task)
    expected = {(g + 1,): float(p) for g, p in enumerate(w / w.sum())}
    observed = {(int(k[0]),): v for k, v in observed.items()}
    assert _chi_square_p(observed, expected, samples) > 1e-3
    # near gaps are the likely ones: gap 1 / gap 30 = 30 ** 0.7 ~ 10.8
    assert observed[(1,)] > 8 * observed[(30,)]


def test_train_and_test_seeds_are_disjoint_and_so_are_their_sequences():
    for seed in (0, 1, 7, TEST_SEED_OFFSET - 1):
        train, test = split_seeds(seed)
        assert train < TEST_SEED_OFFSET <= test
    assert split_seeds(5)[1] != split_seeds(6)[0]
    with pytest.raises(ValueError, match="seed"):
        split_seeds(TEST_SEED_OFFSET)
    train_seed, test_seed = split_seeds(0)
    task = MQARTask(vocab_size=64, seq_len=32, num_kv_pairs=4)
    a, _ = make_batch(task, 3000, train_seed)
    b, _ = make_batch(task, 500, test_seed)
    both = torch.cat([a, b])
    assert torch.unique(both, dim=0).shape[0] == both.shape[0]  # no test sequence is a train sequence


def test_a_seed_determines_the_batch():
    a = make_batch(TASK, 64, seed=9)
    b = make_batch(TASK, 64, seed=9)
    c = make_batch(TASK, 64, seed=10)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


def test_chunked_draw_matches_shapes(monkeypatch):
    import rtcompile.explore.mqar as mqar

    monkeypatch.setattr(mqar, "DRAW_ELEMENTS", 31 * 10)  # 10 rows per chunk: 25 rows -> 3 chunks
    x, y = make_batch(TASK, 25, seed=1)
    assert x.shape == y.shape == (25, TASK.seq_len)
    assert ((y != IGNORE).sum(dim=1) == TASK.num_kv_pairs).all()


def test_query_accuracy_counts_only_scored_positions():
    labels = torch.tensor([[IGNORE, 3, IGNORE, 1], [2, IGNORE, IGNORE, IGNORE]])
    logits = torch.zeros(2, 4, 5)
    logits[0, 1, 3] = 1  # right
    logits[0, 3, 2] = 1  # wrong
    logits[1, 0, 2] = 1  # right
    logits[0, 0, 4] = 9  # unscored positions do not count
    assert query_accuracy(logits, labels) == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="logits"):
        query_accuracy(logits[:, :3], labels)
    with pytest.raises(ValueError, match="labels"):
        query_accuracy(logits, torch.full_like(labels, IGNORE))


@pytest.mark.parametrize("fields, error, name", [
    (dict(vocab_size=2), ValueError, "vocab_size"),
    (dict(vocab_size=12, num_kv_pairs=6), ValueError, "vocab_size"),
    (dict(seq_len=63, num_kv_pairs=16), ValueError, "seq_len"),
    (dict(num_kv_pairs=0), ValueError, "num_kv_pairs"),
    (dict(alpha=0.0), ValueError, "alpha"),
    (dict(alpha=float("nan")), ValueError, "alpha"),
    (dict(alpha="0.1"), TypeError, "alpha"),
    (dict(seq_len=256.0), TypeError, "seq_len"),
    (dict(num_kv_pairs=True), TypeError, "num_kv_pairs"),
])
def test_bad_fields_raise_naming_the_field(fields, error, name):
    with pytest.raises(error, match=rf"MQARTask\.{name}:.*allowed|MQARTask\.{name}: expected"):
        MQARTask(**fields)


def test_the_smallest_fitting_task_is_accepted():
    task = MQARTask(vocab_size=2 * 16 + 1, seq_len=64, num_kv_pairs=16)
    x, y = make_batch(task, 4, seed=0)
    assert ((y != IGNORE).sum(dim=1) == 16).all()


@pytest.mark.parametrize("args, error, name", [
    ((0, 0), ValueError, "num_examples"), ((2, -1), ValueError, "seed"), ((2.0, 0), TypeError, "num_examples"),
    ((2, 1 << 63), ValueError, "seed"),
])
def test_make_batch_refuses_bad_arguments(args, error, name):
    with pytest.raises(error, match=name):
        make_batch(TASK, *args)
