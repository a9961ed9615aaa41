"""A controller's failure turns speculation off and is logged; it never reaches the caller
(``sgl_spec/control/guard.py``)."""

from __future__ import annotations

import logging

import pytest

from sgl_spec.control.chain_steps import ChainSteps
from sgl_spec.control.controller import SpeculationController
from sgl_spec.control.guard import FAILED, NEVER, GuardedController, guarded, served_controller


def _raise(*args, **kwargs):
    raise ZeroDivisionError("planted")


def _drafting_steps() -> ChainSteps:
    """An ``auto`` chain whose controller drafts (every estimate says 3 drafts pay)."""
    steps = ChainSteps("auto", 3, "--standalone-steps")
    drafted = 0
    for _ in range(2000):
        k = steps.choose(1, 64)
        steps.controller.observe_step(k, 1, 0.010 + 0.001 * k)
        if k:
            steps.observe([k])
        drafted = drafted + 1 if k == 3 else 0
        if drafted >= 8:
            return steps
    raise AssertionError("the controller never settled on drafting")


def test_served_controller_is_guarded_and_none_stays_none() -> None:
    steps = ChainSteps("auto", 3, "x")
    assert isinstance(steps.controller, GuardedController)
    assert isinstance(steps.controller._controller, SpeculationController)
    assert served_controller(None) is None and guarded(None) is None
    assert ChainSteps("fixed", 3, "x").controller is None


def test_attributes_read_and_set_through_the_guard() -> None:
    steps = ChainSteps("auto", 3, "x")
    inner = steps.controller._controller
    steps.controller.num_steps_off = 7
    assert inner.num_steps_off == 7 and steps.controller.num_steps_off == 7
    assert steps.controller.config is inner.config
    assert getattr(steps.controller, "no_such_attribute", None) is None  # not a failure
    assert steps.controller.failure is None


def test_a_failing_decide_turns_speculation_off_for_good(monkeypatch, caplog) -> None:
    steps = _drafting_steps()
    inner = steps.controller._controller
    monkeypatch.setattr(inner, "decide", _raise)
    with caplog.at_level(logging.ERROR, logger="sgl_spec.control.guard"):
        assert steps.choose(1, 64) == 0  # the failing call itself answers: no drafts
    assert steps.controller.failure == "ZeroDivisionError: planted"
    failures = [r for r in caplog.records if "controller failed" in r.getMessage()]
    assert len(failures) == 1 and failures[0].exc_info is not None  # with its traceback
    monkeypatch.undo()  # the controller works again: it is not asked any more
    seen = inner.num_steps_seen
    for _ in range(20):
        assert steps.choose(1, 64) == 0
        steps.controller.observe_step(0, 1, 0.01)
        steps.observe([0])
    assert inner.num_steps_seen == seen  # observations dropped
    decision = steps.controller.decide(1, 64)
    assert decision.k == 0 and decision.source == FAILED and decision.lam == 1.0
    assert steps.controller.predict(2, 1, 64).k == 2  # rank 0's setting, run as told
    assert steps.controller.expects_drafts(1, 64) is False
    assert steps.steps_to_probe() == NEVER
    assert len([r for r in caplog.records if "controller failed" in r.getMessage()]) == 1


@pytest.mark.parametrize("where", ["observe_step", "observe", "batch_changed", "steps_to_probe"])
def test_any_failing_call_fails_the_controller(monkeypatch, where: str) -> None:
    steps = _drafting_steps()
    monkeypatch.setattr(steps.controller._controller, where, _raise)
    calls = {
        "observe_step": lambda: steps.controller.observe_step(3, 1, 0.013),
        "observe": lambda: steps.observe([1]),
        "batch_changed": lambda: steps.controller.batch_changed(1, 2),
        "steps_to_probe": lambda: steps.steps_to_probe(),
    }
    steps.steps = 3
    calls[where]()  # does not raise
    assert steps.controller.failure is not None
    assert steps.choose(1, 64) == 0


def test_a_failing_part_fails_its_controller(monkeypatch) -> None:
    """``controller.prices.switched`` (called by the workers) is guarded under the same failure."""
    steps = _drafting_steps()
    prices = steps.controller._controller.prices
    monkeypatch.setattr(prices, "switched", _raise)
    steps.controller.prices.switched(0.01)
    assert steps.controller.failure == "ZeroDivisionError: planted"
    assert steps.choose(1, 64) == 0
    assert steps.controller.prices.switched(0.01) is None  # not asked again


def test_a_failing_property_fails_the_controller(monkeypatch) -> None:
    guard = GuardedController(_Broken())
    assert guard.value is None
    assert guard.failure == "KeyError: 'broken'"
    assert guard.decide(4, 10).k == 0


class _Broken:
    @property
    def value(self) -> int:
        raise KeyError("broken")


def test_the_failure_is_reported_once_to_whoever_counts_it(monkeypatch) -> None:
    steps = _drafting_steps()
    reported: list[str] = []
    steps.controller.when_failed(reported.append)
    monkeypatch.setattr(steps.controller._controller, "decide", _raise)
    steps.choose(1, 64)
    steps.choose(1, 64)
    assert reported == ["ZeroDivisionError: planted"]
    late: list[str] = []
    steps.controller.when_failed(late.append)  # registered after the failure: told at once
    assert late == ["ZeroDivisionError: planted"]


def test_a_failing_report_does_not_reach_the_step(monkeypatch) -> None:
    steps = _drafting_steps()
    steps.controller.when_failed(_raise)
    monkeypatch.setattr(steps.controller._controller, "decide", _raise)
    assert steps.choose(1, 64) == 0
