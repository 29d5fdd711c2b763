"""Tasks and metrics against independent references: brute-force group products,
Python's own evaluation of arithmetic strings, MQAR's structure read back token by
token, and bits per byte on a known distribution."""

from __future__ import annotations

import math

import pytest
import torch

from archspec.errors import ArchspecError
from archspec.search import metrics
from archspec.search.tasks import get_task
from archspec.search.tasks.corpus import SPLIT_SHA256, load_split, markdown_to_text
from archspec.search.tasks.formal import MODULUS, QUERY, to_text
from archspec.search.tasks.groups import group_by_name


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------- groups


@pytest.mark.parametrize("name,order", [("s3", 6), ("s4", 24), ("a5", 60), ("s5", 120), ("z7", 7), ("d5", 10)])
def test_group_orders_and_closure(name, order):
    g = group_by_name(name)
    assert g.order == order
    assert len(set(g.elements)) == order
    assert g.elements[0] == tuple(range(g.degree))  # identity first
    # Every row and column of a group's table is a permutation (Latin square).
    for row in g.table:
        assert sorted(row.tolist()) == list(range(order))
    for col in g.table.T:
        assert sorted(col.tolist()) == list(range(order))


def test_group_structure_facts():
    # S3 and D3 are isomorphic but Z6 is not: only Z6 has an element of order 6.
    def max_element_order(name):
        g = group_by_name(name)
        best = 0
        for p in g.elements:
            q, k = p, 1
            while q != g.elements[0]:
                q, k = tuple(p[i] for i in q), k + 1
            best = max(best, k)
        return best

    assert max_element_order("s3") == 3 and max_element_order("d3") == 3 and max_element_order("z6") == 6
    assert max_element_order("a5") == 5  # A5 has elements of orders 1, 2, 3, 5
    # A5 is perfect: not abelian, and a5 has no element that commutes with everything but e.
    a5 = group_by_name("a5")
    center = [p for p in a5.elements if all(tuple(p[i] for i in q) == tuple(q[i] for i in p) for q in a5.elements)]
    assert center == [a5.elements[0]]


@pytest.mark.parametrize("name", ["s3", "a5", "d4", "z5"])
def test_group_targets_are_running_products(name):
    task = get_task(name, train_len=12)
    batch = task.train_batch(6, gen(1))
    g = task.group
    for x_row, y_row in zip(batch.inputs.tolist(), batch.targets.tolist()):
        product = tuple(range(g.degree))
        for x, y in zip(x_row, y_row):
            step = g.elements[x]
            product = tuple(step[i] for i in product)  # x_t * (x_{t-1} ... x_1): apply the old product first
            assert g.elements[y] == product
    assert bool(batch.mask.all())


def test_group_eval_split_is_fixed_and_metrics_at_prefixes():
    task = get_task("s3", train_len=8, eval_size=32)
    again = get_task("s3", train_len=8, eval_size=32)
    test = task.eval_sets()["test"]
    assert test.inputs.shape == (32, 32)
    assert torch.equal(test.inputs, again.eval_sets()["test"].inputs)
    assert not torch.equal(test.inputs, get_task("s3", train_len=8, eval_size=32, eval_seed=1).eval_sets()["test"].inputs)
    # Perfect logits but for one wrong token at position 10 (1-based 11) of sequence 0.
    logits = torch.nn.functional.one_hot(test.targets, task.vocab_size).float()
    logits[0, 10] = torch.roll(logits[0, 10], 1)
    m = task.metrics(logits, test.targets, test.mask, "test")
    assert m["token_acc@8"] == 1.0 and m["seq_acc@8"] == 1.0
    assert m["token_acc@16"] == pytest.approx(1 - 1 / (32 * 16))
    assert m["seq_acc@16"] == pytest.approx(31 / 32)
    assert m["seq_acc@32"] == pytest.approx(31 / 32)


def test_unknown_group_and_option_are_clear_errors():
    with pytest.raises(ArchspecError, match="unknown task 'q9'"):
        get_task("q9")
    with pytest.raises(ArchspecError, match="order 5040"):
        get_task("s7")
    with pytest.raises(ArchspecError, match="unknown option.*lenght.*accepts"):
        get_task("s3", lenght=4)
    with pytest.raises(ArchspecError, match="unknown preset"):
        get_task("s3", preset="tpu")


@pytest.mark.parametrize("typo, meant", [("s33", "s3"), ("mqar_twise", "mqar_twice"), ("partiy", "parity"), ("a55", "a5")])
def test_a_mistyped_task_name_gets_did_you_mean(typo, meant):
    with pytest.raises(ArchspecError, match=rf"\(did you mean {meant}\?\)"):
        get_task(typo)


# ---------------------------------------------------------------------------- formal languages


def test_parity_answers():
    task = get_task("parity")
    batch = task.train_batch(50, gen(2))
    length = batch.inputs.shape[1] - 1
    assert 3 <= length <= 40
    for row, target, mask in zip(batch.inputs.tolist(), batch.targets.tolist(), batch.mask.tolist()):
        assert row[-1] == 2 and mask == [False] * length + [True]
        assert target[-1] == sum(row[:-1]) % 2


def test_mod_arith_matches_python_evaluation():
    task = get_task("mod_arith")
    seen_lengths = set()
    for seed in range(10):
        batch = task.train_batch(20, gen(seed))
        seen_lengths.add(batch.inputs.shape[1] - 1)
        for row, target in zip(batch.inputs.tolist(), batch.targets.tolist()):
            assert row[-1] == QUERY
            expr = to_text(row[:-1])
            assert len(expr) % 2 == 1
            assert target[-1] == eval(expr) % MODULUS  # noqa: S307  Python's precedence: * before + -
    assert len(seen_lengths) > 3  # lengths vary from batch to batch


@pytest.mark.parametrize("mult", [False, True])
def test_mod_arith_brackets_matches_python_evaluation(mult):
    task = get_task("mod_arith_brackets", mult=mult, eval_lengths=(7, 23, 64), eval_size=40)
    for name, batch in task.eval_sets().items():
        n = int(name.removeprefix("len"))
        assert batch.inputs.shape[1] == n + 1  # exact length plus the query
        for row, target in zip(batch.inputs.tolist(), batch.targets.tolist()):
            expr = to_text(row[:-1])
            assert ("*" in expr) <= mult
            assert expr.count("(") == expr.count(")")
            assert target[-1] == eval(expr) % MODULUS  # noqa: S307


def test_scaled_accuracy_and_summary():
    assert metrics.scaled_accuracy(0.2, 5) == pytest.approx(0.0)
    assert metrics.scaled_accuracy(1.0, 5) == pytest.approx(1.0)
    assert metrics.scaled_accuracy(0.75, 2) == pytest.approx(0.5)
    task = get_task("parity", eval_lengths=(40, 80), eval_size=64)
    out = {}
    for split, batch in task.eval_sets().items():
        # Always answer 0: right on exactly the even-parity strings.
        logits = torch.zeros(*batch.inputs.shape, task.vocab_size)
        logits[..., 0] = 1.0
        out.update(task.metrics(logits, batch.targets, batch.mask, split))
        even = float((batch.targets[:, -1] == 0).double().mean())
        n = int(split.removeprefix("len"))
        assert out[f"token_acc@{n}"] == pytest.approx(even)
        assert out[f"scaled_acc@{n}"] == pytest.approx(2 * even - 1)
    assert task.summarize(out)["scaled_acc"] == pytest.approx((out["scaled_acc@40"] + out["scaled_acc@80"]) / 2)


# ---------------------------------------------------------------------------- recall


@pytest.mark.parametrize("name,passes", [("mqar", 1), ("mqar_twice", 2)])
def test_mqar_structure(name, passes):
    task = get_task(name, seq_len=64, num_kv_pairs=6, vocab=64)
    batch = task.train_batch(8, gen(3))
    context = 2 * 6 * passes
    for x, y, m in zip(batch.inputs.tolist(), batch.targets.tolist(), batch.mask.tolist()):
        pairs = x[:12]
        keys, values = pairs[0::2], pairs[1::2]
        assert len(set(keys)) == 6 and len(set(values)) == 6
        assert all(1 <= k < 32 for k in keys) and all(32 <= v < 64 for v in values)
        assert x[:context] == pairs * passes  # the context, shown `passes` times
        table = dict(zip(keys, values))
        queried = [t for t in range(64) if m[t]]
        assert len(queried) == 6 and all(t >= context and (t - context) % 2 == 0 for t in queried)
        assert sorted(x[t] for t in queried) == sorted(keys)  # each key asked once
        assert all(y[t] == table[x[t]] for t in queried)


def test_mqar_power_law_prefers_near_queries():
    task = get_task("mqar", seq_len=256, num_kv_pairs=4, vocab=64, power_a=0.01)
    batch = task.train_batch(400, gen(4))
    slots = (batch.mask.nonzero()[:, 1] - task.context_len) // 2
    space = task.query_slots
    assert float((slots < space // 4).double().mean()) > 0.5  # uniform would give 0.25


def test_mqar_rejects_impossible_sizes():
    with pytest.raises(ArchspecError, match="query slots"):
        get_task("mqar_twice", seq_len=40, num_kv_pairs=8)


# ---------------------------------------------------------------------------- bytes


def test_corpus_is_shipped_checked_and_plain():
    train, heldout = load_split("train"), load_split("heldout")
    assert 1_000_000 <= len(train) + len(heldout) <= 5_000_000
    assert len(SPLIT_SHA256) == 2
    assert b"Out, damned spot" in heldout and b"Out, damned spot" not in train  # Macbeth is held out
    assert b"**" not in train and b"##" not in train
    assert markdown_to_text("# Title\n\n**HAMLET**  \nTo be, or not\\--_aside_\n") == "Title\n\nHAMLET\nTo be, or not--aside\n"


def test_bytes_windows_shift_by_one():
    task = get_task("bytes_lm", seq_len=32, eval_windows=8)
    batch = task.train_batch(4, gen(5))
    assert torch.equal(batch.inputs[:, 1:], batch.targets[:, :-1])
    text = load_split("heldout")
    held = task.eval_sets()["heldout"]
    first = bytes(held.inputs[0].tolist())
    assert text.startswith(first)


def test_bits_per_byte_of_a_known_distribution():
    # A model that puts probability 1/2 on the target everywhere scores exactly 1 bpb;
    # a uniform model over 256 bytes scores 8.
    task = get_task("bytes_lm", seq_len=16, eval_windows=4)
    batch = task.eval_sets()["heldout"]
    uniform = torch.zeros(*batch.inputs.shape, 256)
    assert task.metrics(uniform, batch.targets, batch.mask, "heldout")["bpb"] == pytest.approx(8.0)
    half = torch.full((*batch.inputs.shape, 256), -1e9)
    half.scatter_(-1, batch.targets[..., None], 0.0)
    half.scatter_(-1, ((batch.targets + 1) % 256)[..., None], 0.0)
    assert task.metrics(half, batch.targets, batch.mask, "heldout")["bpb"] == pytest.approx(1.0)


# ---------------------------------------------------------------------------- metrics


def test_sequence_and_position_metrics_by_hand():
    correct = torch.tensor([[1, 1, 0, 1], [1, 1, 1, 1], [0, 1, 1, 1]], dtype=torch.bool)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [0, 1, 1, 1]], dtype=torch.bool)
    o = metrics.TokenOutcome(correct & mask, torch.zeros(3, 4, dtype=torch.float64), mask)
    assert metrics.token_accuracy(o) == pytest.approx(9 / 10)
    assert metrics.token_accuracy(o, 2) == pytest.approx(4 / 4)
    assert metrics.sequence_accuracy(o) == pytest.approx(2 / 3)
    assert metrics.sequence_accuracy(o, 2) == pytest.approx(1.0)
    assert metrics.per_position_accuracy(o).tolist() == pytest.approx([1.0, 1.0, 2 / 3, 1.0])
    assert metrics.prefix_sequence_accuracy(o).tolist() == pytest.approx([1.0, 1.0, 2 / 3, 2 / 3])
    assert metrics.geometric_mean(torch.tensor([0.25, 1.0, float("nan")])) == pytest.approx(0.5)
    assert math.isnan(metrics.token_accuracy(metrics.TokenOutcome(correct, o.nll, torch.zeros_like(mask))))


def test_outcome_from_logits():
    logits = torch.tensor([[[2.0, 0.0], [0.0, 0.0]]])
    o = metrics.outcome_from_logits(logits, torch.tensor([[0, 1]]), torch.tensor([[True, True]]))
    assert o.correct.tolist() == [[True, False]]  # a tie resolves to class 0
    assert o.nll[0, 0].item() == pytest.approx(math.log(1 + math.exp(-2.0)))
    assert o.nll[0, 1].item() == pytest.approx(math.log(2.0))


def test_every_task_is_deterministic_under_its_generator():
    for name in ["s3", "parity", "mod_arith", "mod_arith_brackets", "mqar", "mqar_twice", "bytes_lm"]:
        task = get_task(name)
        a, b = task.train_batch(4, gen(7)), task.train_batch(4, gen(7))
        assert all(torch.equal(x, y) for x, y in zip(a, b)), name
        assert a.inputs.max() < task.vocab_size and a.targets.max() < task.vocab_size

