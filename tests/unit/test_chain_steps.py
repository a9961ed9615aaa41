"""``ChainSteps`` (``sgl_spec/control/chain_steps.py``): who names each step's number of drafts
for STANDALONE_FULL (``--standalone-steps``) and MINEDRAFT (``--minedraft-steps``)."""

from __future__ import annotations

import pytest

from sgl_spec.control.chain_steps import ChainSteps


def test_fixed_cycle_and_off_need_no_controller() -> None:
    fixed = ChainSteps("fixed", 3, "--minedraft-steps")
    cycle = ChainSteps("cycle", 3, "--minedraft-steps")
    off = ChainSteps("off", 3, "--minedraft-steps")
    assert fixed.controller is cycle.controller is off.controller is None
    assert [fixed.choose(4, 100) for _ in range(3)] == [3, 3, 3]
    assert [cycle.choose(4, 100) for _ in range(6)] == [0, 1, 2, 3, 0, 1]
    assert [off.choose(4, 100) for _ in range(3)] == [0, 0, 0]
    off.observe([1, 2])  # no controller: nothing to learn, nothing raised


@pytest.mark.parametrize(("mode", "steps"), [("sometimes", 3), ("auto", 0)])
def test_bad_settings_name_the_flag(mode: str, steps: int) -> None:
    with pytest.raises(ValueError, match="--minedraft-steps"):
        ChainSteps(mode, steps, "--minedraft-steps")


def test_auto_learns_acceptance_only_at_the_length_it_ran() -> None:
    """Acceptance counts for the length chosen last; a plain step (0) teaches nothing."""
    steps = ChainSteps("auto", 3, "--minedraft-steps")
    controller = steps.controller
    before = list(controller.alphas)
    steps.steps = 0
    steps.observe([0, 0])
    assert controller.alphas == before
    steps.steps = 3
    steps.observe([0, 0, 0])
    assert controller.alphas[0] < before[0]
