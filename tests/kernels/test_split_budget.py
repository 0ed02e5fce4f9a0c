"""split_budget: the capacity-coordinated split (eq:capacity_nominal, eq:capacity_split).

The expected budgets come from integer arithmetic on the decimal digits of the ratios (``budget_oracle.exact_budget``,
the oracle every budget test shares), not from the Fraction arithmetic of the implementation:
``floor(p n / q + 1/2) = (2 p n + q) // (2 q)`` for rho = p / q.
"""

import math
from fractions import Fraction

import pytest
from budget_oracle import exact_budget, ratio_digits
from hypothesis import given
from hypothesis import strategies as st

from macer_kernels import Budget, split_budget


def test_paper_7b_default_case():
    # 1460 audio + 864 video at rho = 0.25, alpha = 0.30: K_mm = floor(581 + 0.5) = 581, Kbar_a = floor(174.3 + .5).
    assert split_budget(1460, 864, 0.25, 0.30) == Budget(total=581, audio=174, video=407)


def test_rounding_is_floor_x_plus_half_not_bankers():
    # 0.5 * 5 = 2.5 -> 3 (Python's round() would give 2); alpha * K_mm = 0.5 * 3 = 1.5 -> 2 (round() gives 2 too).
    assert split_budget(3, 2, 0.5, 0.5) == Budget(3, 2, 1)
    # alpha * K_mm = 0.25 * 10 = 2.5 -> 3.
    assert split_budget(10, 10, 0.5, 0.25) == Budget(10, 3, 7)


@pytest.mark.parametrize(
    ("n_audio", "n_video", "expected"),
    [
        (0, 100, Budget(25, 0, 25)),  # no audio: all capacity to video
        (100, 0, Budget(25, 25, 0)),  # no video: all capacity to audio
        (0, 0, Budget(0, 0, 0)),
        (3, 100, Budget(26, 3, 23)),  # audio short of its nominal 8: 5 slots reassigned to video
        (100, 4, Budget(26, 22, 4)),  # video short of its nominal 18: 14 slots reassigned to audio
    ],
)
def test_reassignment_when_a_modality_is_short(n_audio, n_video, expected):
    assert split_budget(n_audio, n_video, 0.25, 0.30) == expected


def test_half_way_products_round_up_as_written_in_decimal():
    # 0.35 * 90 = 31.5 exactly, but 31.499999999999996 in float arithmetic (the float 0.35 is slightly below 0.35).
    assert split_budget(45, 45, 0.35, 0.3) == Budget(32, 10, 22)
    # alpha K_mm half-way: 0.35 * 10 = 3.5 -> 4 (float: 3.4999999999999996 -> 3).
    assert split_budget(10, 10, 0.5, 0.35) == Budget(10, 4, 6)
    # 0.7 * 5 = 3.5 -> 4 (float: 3.4999999999999996 -> 3).
    assert split_budget(2, 3, 0.7, 0.5) == Budget(4, 2, 2)


ALPHAS = ("0.3", "0.35", "0.5", "0.15")


@pytest.mark.parametrize("rho", ["0.25", "0.35", "0.45", "0.7"])
def test_every_count_below_5000_matches_exact_integer_arithmetic(rho):
    # The paper's keep ratios (and 0.7) over every n < 5000; the audio shares take turns (n % 4) and hit half-way
    # products alpha K_mm; audio from balanced to short (n % 37 tokens), so the reassignment runs too.
    rp, rq = ratio_digits(rho)
    half_way_totals = half_way_shares = 0
    for n in range(5000):
        alpha = ALPHAS[n % len(ALPHAS)]
        for n_audio in (n // 2, n % 37):
            want = exact_budget(n_audio, n - n_audio, rho, alpha)
            got = split_budget(n_audio, n - n_audio, float(rho), float(alpha))
            assert got == want, (n_audio, n - n_audio, rho, alpha)
        ap, aq = ratio_digits(alpha)
        half_way_totals += (2 * rp * n) % (2 * rq) == rq
        half_way_shares += (2 * ap * want.total) % (2 * aq) == aq
    # The sweep holds half-way points of both products, among them those that float arithmetic rounds down.
    float_misses = sum(math.floor(float(rho) * n + 0.5) != (2 * rp * n + rq) // (2 * rq) for n in range(5000))
    assert half_way_totals > 100 and half_way_shares > 100
    assert float_misses == {"0.25": 0, "0.35": 36, "0.45": 0, "0.7": 73}[rho]


def test_fractions_are_exact_and_long_floats_read_as_printed():
    # A Fraction is used as given; a float that is not a short decimal reads as the digits its repr prints.
    assert split_budget(3, 0, Fraction(1, 2), 0) == Budget(2, 2, 0)  # 1.5 -> 2
    assert split_budget(10, 0, Fraction(1, 4), Fraction(1, 2)) == Budget(3, 3, 0)  # K_mm = floor(3) = 3
    # 1/6 as a float reads as 0.16666666666666666 (what repr prints): 9 times that is just below 1.5, so K_mm = 1;
    # Fraction(1, 6) is exact: 9/6 = 1.5 -> 2.
    assert split_budget(9, 0, 1 / 6, 0.5).total == 1
    assert split_budget(9, 0, Fraction(1, 6), 0.5).total == 2


def test_keep_ratio_one_keeps_everything():
    assert split_budget(1460, 864, 1.0, 0.3) == Budget(2324, 1460, 864)
    assert split_budget(7, 0, 1.0, 0.0) == Budget(7, 7, 0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n_audio": -1}, "n_audio must be a non-negative integer"),
        ({"n_video": 2.0}, "n_video must be a non-negative integer"),
        ({"n_audio": True}, "n_audio must be a non-negative integer"),
        ({"keep_ratio": 0.0}, r"keep_ratio must be in \(0.0, 1.0\]"),
        ({"keep_ratio": 1.01}, r"keep_ratio must be in \(0.0, 1.0\]"),
        ({"keep_ratio": float("nan")}, "keep_ratio must be a real number"),
        ({"keep_ratio": "0.5"}, "keep_ratio must be a real number"),
        ({"audio_share": -0.1}, r"audio_share must be in \[0.0, 1.0\]"),
        ({"audio_share": 1.5}, r"audio_share must be in \[0.0, 1.0\]"),
        # Just outside the range, but 1.0 once rounded to a float: the exact value is checked.
        ({"keep_ratio": Fraction(10**20 + 1, 10**20)}, r"keep_ratio must be in \(0.0, 1.0\]"),
        ({"audio_share": Fraction(10**20 + 1, 10**20)}, r"audio_share must be in \[0.0, 1.0\]"),
    ],
)
def test_errors_name_the_parameter_and_range(kwargs, message):
    args = {"n_audio": 10, "n_video": 10, "keep_ratio": 0.5, "audio_share": 0.3, **kwargs}
    with pytest.raises(ValueError, match=message):
        split_budget(**args)


@given(
    n_audio=st.integers(0, 50_000),
    n_video=st.integers(0, 50_000),
    keep_ratio=st.floats(1e-6, 1.0, exclude_min=False),
    audio_share=st.floats(0.0, 1.0),
)
def test_budget_invariants(n_audio, n_video, keep_ratio, audio_share):
    b = split_budget(n_audio, n_video, keep_ratio, audio_share)
    assert b.total == b.audio + b.video
    assert b == exact_budget(n_audio, n_video, repr(keep_ratio), repr(audio_share))
    assert 0 <= b.audio <= n_audio and 0 <= b.video <= n_video
    ap, aq = ratio_digits(repr(audio_share))
    nominal_audio = (2 * ap * b.total + aq) // (2 * aq)
    # Neither modality gets less than its nominal share unless it lacks the tokens.
    assert b.audio >= min(n_audio, nominal_audio)
    assert b.video >= min(n_video, b.total - nominal_audio)


# ---------------------------------------------------------------------------------------------------------------
# The integer path the policies plan with (issue 37): split_budget_exact and exact_ratio
# ---------------------------------------------------------------------------------------------------------------

_RATIOS = st.one_of(
    st.fractions(min_value=0, max_value=1, max_denominator=10**30),
    st.sampled_from([Fraction(1, 2), Fraction(7, 20), Fraction(1, 3), Fraction(2, 3), Fraction(0), Fraction(1)]),
)


@given(n_audio=st.integers(0, 10**7), n_video=st.integers(0, 10**7), keep_ratio=_RATIOS, audio_share=_RATIOS)
def test_integer_split_equals_the_fraction_reference(n_audio, n_video, keep_ratio, audio_share):
    """The policies' integer arithmetic against ``split_budget_ref``'s ``Fraction`` arithmetic (floor(x + 1/2) of
    exact rationals, denominators up to 10**30), reassignment included."""
    from macer_kernels.reference import split_budget_ref
    from macer_kernels.split_budget import split_budget_exact

    if keep_ratio == 0:
        keep_ratio = Fraction(1, 10**30)
    assert split_budget_exact(n_audio, n_video, keep_ratio, audio_share) == split_budget_ref(
        n_audio, n_video, keep_ratio, audio_share)


def test_exact_ratio_reads_each_type_as_split_budget_does():
    """The ratio cache keys on type and value: numpy's float32 0.35 prints "0.35" (35/100), the Python float
    nearest to it prints its 16 digits, and the two compare equal, so an untyped cache would give one the other's
    fraction."""
    import numpy as np

    from macer_kernels.split_budget import exact_ratio

    near = float(np.float32(0.35))
    assert np.float32(0.35) == near
    assert exact_ratio(np.float32(0.35)) == Fraction(35, 100)
    assert exact_ratio(near) == Fraction(repr(near)) != Fraction(35, 100)
    assert exact_ratio(np.float32(0.35)) == Fraction(35, 100)  # again, after the float's entry
    assert exact_ratio(0.35) == Fraction(7, 20) and exact_ratio(Fraction(1, 3)) == Fraction(1, 3)
    assert exact_ratio(1) == 1 and exact_ratio(True) == 1
