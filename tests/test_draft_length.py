"""`DraftLength`: how many tokens each round of speculative decoding drafts.

The rule: the ``k`` (at most the request's ``num_draft_tokens``) with the most tokens per
unit of cost, ``(1 + a + ... + a^k) / (1 + k c)``; none while no ``k`` pays, with probes
that re-measure the acceptance; a draft as large as the target never drafts, and the
front ends set it aside (`draft_set_aside`).
"""

import threading

import pytest

from mlx_kvcache.generation.draft_length import (DraftLength, DraftLengths, draft_cost,
                                                 draft_set_aside)
from mlx_kvcache.testing import build


def brute_best(a, c, most):
    rates = [sum(a ** i for i in range(k + 1)) / (1 + k * c) for k in range(most + 1)]
    return rates.index(max(rates))


@pytest.mark.parametrize("a", [0.0, 0.2, 0.5, 0.7, 0.9, 0.99])
@pytest.mark.parametrize("c", [0.0, 0.02, 0.1, 0.3, 0.6, 1.0, 2.0])
def test_best_is_the_fastest_round(a, c):
    dl = DraftLength(c)
    for most in (0, 1, 3, 8):
        assert dl.best(most, a) == brute_best(a, c, most)
    assert dl.speed(0, a) == 1.0


def test_a_draft_as_large_as_the_target_never_drafts_nor_probes():
    dl = DraftLength(1.0, prior=0.99)
    assert [dl.next(5) for _ in range(300)] == [0] * 300
    dl.observe(5, 5)  # even a draft that was always right
    assert dl.next(5) == 0


def test_a_cheap_good_draft_drafts_all_it_may():
    dl = DraftLength(0.05)
    ks = []
    for _ in range(50):
        ks.append(dl.next(4))
        dl.observe(ks[-1], ks[-1])  # every proposal accepted
    assert ks == [4] * 50
    assert dl.next(2) == 2 and dl.next(0) == 0 and dl.next(-1) == 0


def test_poor_acceptance_stops_drafting_then_probes_less_and_less_often():
    dl = DraftLength(0.3)
    assert dl.next(3) > 0  # the prior: drafting pays
    rounds = []
    for _ in range(400):
        k = dl.next(3)
        rounds.append(k)
        dl.observe(k, 0)  # every proposal rejected
    assert dl.acceptance < 0.3
    drafting = [i for i, k in enumerate(rounds) if k]
    # a few rounds while the estimate falls, then one-token probes whose gaps double to 128
    assert len(drafting) < 15
    gaps = [b - a for a, b in zip(drafting, drafting[1:])][-4:]
    assert gaps[-1] == DraftLength.PROBE_MOST
    assert all(rounds[i] == 1 for i in drafting[-4:])
    # the text becomes easy to draft: a probe is accepted, and drafting comes back
    k, n = 0, 0
    while k == 0:
        k = dl.next(3)
        n += 1
    assert n <= DraftLength.PROBE_MOST
    for _ in range(20):
        dl.observe(k, k)
        k = dl.next(3)
    assert k == 3


def test_decisions_depend_only_on_what_was_observed():
    def replay():
        dl = DraftLength(0.25)
        out = []
        for i in range(200):
            k = dl.next(4)
            out.append(k)
            dl.observe(k, min(k, (i * 7) % 5))
        return out
    assert replay() == replay()


def test_cost_is_the_ratio_of_weight_bytes():
    big, small = build("llama"), build("llama", hidden_size=32, intermediate_size=64)
    assert draft_cost(big, big) == 1.0
    assert 0 < draft_cost(big, small) < 0.6
    assert draft_cost(small, big) > 1


def test_only_a_draft_that_could_never_pay_is_set_aside():
    big, small = build("llama"), build("llama", hidden_size=32, intermediate_size=64)
    why = draft_set_aside("adaptive", big, build("llama"))
    assert why == ("a step of the draft model costs 1.00 of a step of the model (their weight "
                   "bytes), so drafting can never pay for itself")
    assert draft_set_aside("adaptive", small, big).startswith(
        f"a step of the draft model costs {draft_cost(small, big):.2f} of")
    assert draft_set_aside("adaptive", big, small) is None  # it may pay: it is used
    assert draft_set_aside("fixed", big, big) is None  # fixed drafts whatever it costs
    assert draft_set_aside("adaptive", big, None) is None
    with pytest.raises(ValueError, match="draft_policy must be one of"):
        draft_set_aside("never", big, big)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="cost must be >= 0"):
        DraftLength(-0.5)
    with pytest.raises(ValueError, match="draft_policy must be one of adaptive, fixed"):
        DraftLengths("always")


def test_lengths_per_pair_and_policy():
    t, d, d2 = build("llama"), build("llama", hidden_size=32, intermediate_size=64), build("llama")
    lengths = DraftLengths("adaptive")
    assert lengths.current is None
    one = lengths.for_pair(t, d)
    assert one is lengths.for_pair(t, d) is lengths.current  # learning carries over
    assert lengths.for_pair(t, d2) is not one and lengths.current.cost == 1.0  # a new pair
    assert lengths.for_pair(t, None) is None
    assert DraftLengths("fixed").for_pair(t, d) is None


def test_lengths_do_not_keep_a_switched_out_pair_alive():
    import gc
    import weakref

    t, d = build("llama"), build("llama", hidden_size=32, intermediate_size=64)
    lengths = DraftLengths("adaptive")
    one = lengths.for_pair(t, d)
    assert lengths.for_pair(t, d) is one
    gone = weakref.ref(d), weakref.ref(t)
    del t, d
    gc.collect()
    assert gone[0]() is None and gone[1]() is None  # freed: a model switch returns the weights
    assert lengths.current is one


def test_shared_by_threads():
    dl = DraftLength(0.1)

    def work():
        for _ in range(2000):
            k = dl.next(3)
            dl.observe(k, k // 2)
    ts = [threading.Thread(target=work) for _ in range(4)]
    for th in ts:
        th.start()
    for th in ts:
        th.join(60)
    assert 0 < dl.acceptance < 1
