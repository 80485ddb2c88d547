"""The FAST-mode engine's credit arithmetic (serial): credit recovery ends a backward pass
when the root holds all the credit again, so splits and sums must be exact."""

from __future__ import annotations

import random
from fractions import Fraction

from lightning_distgrad.autograd._credit import (
    ALL_CREDIT,
    NO_CREDIT,
    add_credit,
    is_all_credit,
    split_credit,
)


def test_credits_split_and_sum_back_exactly():
    """Credit recovery ends a pass when the root holds all credit again: splitting among any
    number of messages and summing back must be exact, however deep the split goes."""

    def value(credit):
        return Fraction(credit[0], 1 << credit[1])

    rng = random.Random(0)
    for _ in range(500):
        out, back = [ALL_CREDIT], NO_CREDIT
        for _ in range(rng.randint(1, 60)):  # a worker ships k messages, keeps the rest
            credit = out.pop(rng.randrange(len(out)))
            k = rng.randint(1, 9)
            share, rest = split_credit(credit, k)
            assert share[0] > 0 and rest[0] >= 0
            assert value(share) * k + value(rest) == value(credit)
            out += [share] * k
            back = add_credit(back, rest)
            if not out:
                break
            assert not is_all_credit(back)  # credit still out: the pass is not over
        for credit in out:
            back = add_credit(back, credit)
        assert is_all_credit(back) and value(back) == 1
