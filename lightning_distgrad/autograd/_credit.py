"""Credits of a backward pass: exact dyadic fractions ``n / 2**e`` as ``(n, e)`` int pairs.

The root of a pass starts with all the credit; every message of the pass carries
a share and every worker returns what it keeps, so the pass is over exactly when
the root holds all of it again. Splitting and summing are integer arithmetic,
shares travel as the pair, and unlike a fixed integer budget they never run out.
"""

from __future__ import annotations

Credit = tuple[int, int]
NO_CREDIT: Credit = (0, 0)
ALL_CREDIT: Credit = (1, 0)


def split_credit(credit: Credit, parts: int) -> tuple[Credit, Credit]:
    """(each of ``parts`` equal shares, the remainder).

    ``parts`` shares plus the remainder make ``credit`` exactly.

    Example::
        >>> split_credit((1, 0), 3)
        ((1, 2), (1, 2))
    """
    n, e = credit
    bits = (parts - 1).bit_length()  # 2**bits >= parts
    return (n, e + bits), (n * ((1 << bits) - parts), e + bits)


def add_credit(a: Credit, b: Credit) -> Credit:
    """The exact sum of two credits.

    Example::
        >>> add_credit((1, 2), (1, 1))
        (3, 2)
    """
    (n1, e1), (n2, e2) = a, b
    if e1 < e2:
        return (n1 << (e2 - e1)) + n2, e2
    return n1 + (n2 << (e1 - e2)), e1


def is_all_credit(credit: Credit) -> bool:
    """Whether ``credit`` is the whole (1).

    Example::
        >>> is_all_credit((4, 2))
        True
    """
    n, e = credit
    return n == 1 << e
