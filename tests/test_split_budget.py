"""split_budget: the capacity-coordinated split (eq:capacity_nominal, eq:capacity_split)."""

import math

import pytest
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
    n = n_audio + n_video
    assert b.total == b.audio + b.video
    assert b.total == min(n, math.floor(keep_ratio * n + 0.5))
    assert 0 <= b.audio <= n_audio and 0 <= b.video <= n_video
    nominal_audio = math.floor(audio_share * b.total + 0.5)
    # Neither modality gets less than its nominal share unless it lacks the tokens.
    assert b.audio >= min(n_audio, nominal_audio)
    assert b.video >= min(n_video, b.total - nominal_audio)
