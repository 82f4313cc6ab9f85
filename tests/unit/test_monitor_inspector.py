"""The inspector's group-normalised advantages against hand-computed values."""

from __future__ import annotations

import pytest

from decentrl.monitor.inspector import group_advantages


def test_group_advantages_are_the_grpo_form():
    # mean 0.5, unbiased std sqrt(1/3) = 0.57735: (1 - 0.5) / 0.57735 = 0.86603
    assert group_advantages([1.0, 0.0, 0.0, 1.0]) == pytest.approx(
        [0.86603, -0.86603, -0.86603, 0.86603], abs=1e-4
    )
    assert group_advantages([1.0, 1.0, 1.0]) == [0.0, 0.0, 0.0]  # no signal, no NaN
    assert group_advantages([0.3]) == [0.0]
