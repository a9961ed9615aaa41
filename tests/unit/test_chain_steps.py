"""``ChainSteps`` (``sgl_spec/control/chain_steps.py``): who names each step's number of drafts
for STANDALONE_FULL (``--standalone-steps``) and MINEDRAFT (``--minedraft-steps``)."""

from __future__ import annotations

import pytest

from sgl_spec.control.chain_steps import ChainSteps, steps_controller
from sgl_spec.control.step_times import StepClock


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


def test_steps_to_probe_says_when_a_drafted_step_is_due() -> None:
    """MINEDRAFT sends its draft server what it lags only this close to a drafted step."""
    assert ChainSteps("off", 3, "x").steps_to_probe() > 10**6
    assert ChainSteps("cycle", 3, "x").steps_to_probe() == 0
    auto = ChainSteps("auto", 3, "x")
    controller = auto.controller
    controller.num_steps_off = 10  # off, 10 plain steps since the last probe
    assert auto.steps_to_probe() == controller.config.explore_every - 10
    controller.batch_changed(1, 1)  # a new request at one request: probed within 2 steps
    assert auto.steps_to_probe() == 2
    controller.num_steps_on = 1
    assert auto.steps_to_probe() == 0


def serve_turning_over(
    steps: ChainSteps, join_cost: float, num_steps: int = 3000, batch: int = 32, length: int = 128
) -> tuple[list[int], float]:
    """A served batch of ``batch`` requests of ``length`` tokens at acceptance 0.8 per position,
    a finished request replaced at once; a decode step costs 45 ms + 20 ms per draft, a new
    request's prefill 10 ms, and the next step with drafts ``join_cost`` per new request (a
    draft model taking the new prompt). Returns the settings chosen and tokens per second."""
    import random

    rng = random.Random(7)
    clock = StepClock()
    remaining = {f"r{i}": rng.randint(1, length) for i in range(batch)}
    next_rid, now, tokens, chosen, joined = batch, 0.0, 0, [], 0
    for _ in range(num_steps):
        key = tuple(remaining)
        if steps.controller is not None:
            clock.start(key, now, steps.controller)
        k = steps.choose(len(key), 200)
        clock.chosen(k, len(key))
        chosen.append(k)
        now += 0.045 + 0.020 * k + (join_cost * joined if k else 0.0)
        joined = 0
        accepted = [next((a for a in range(k) if rng.random() > 0.8), k) for _ in key]
        steps.observe(accepted)
        for rid, a in zip(key, accepted, strict=True):
            tokens += min(1 + a, remaining[rid])
            remaining[rid] -= 1 + a
            if remaining[rid] <= 0:
                del remaining[rid]
                remaining[f"r{next_rid}"] = length
                next_rid, joined, now = next_rid + 1, joined + 1, now + 0.010
    return chosen, tokens / now


def test_auto_prices_the_steps_after_a_join_at_high_concurrency() -> None:
    """A full chain turns a 32-request batch over every step or two; when the draft model's
    catch-up on each new prompt makes drafting cost more than it commits, ``auto`` stays near
    plain decoding; it only measures that from steps timed across batch changes (the same
    stream timed between identical batches only, the post-join steps are never seen and
    drafting looks cheap); and where joins cost the drafts nothing, it drafts."""
    _, plain = serve_turning_over(ChainSteps("off", 3, "--minedraft-steps"), join_cost=0.060)
    _, full = serve_turning_over(ChainSteps("fixed", 3, "--minedraft-steps"), join_cost=0.060)
    assert full < 0.92 * plain  # the scenario: drafting costs here

    auto = ChainSteps("auto", 3, "--minedraft-steps")
    chosen, rate = serve_turning_over(auto, join_cost=0.060)
    assert sum(chosen[-1000:]) / 1000 < 0.3
    assert rate > 0.97 * plain

    identical_only = ChainSteps("auto", 3, "--minedraft-steps")
    identical_only.controller = steps_controller(  # every step timed that can be
        3, time_chunk=1, time_batch_changes=False, steady_times=False, plausible_probes=False
    )
    chosen, _ = serve_turning_over(identical_only, join_cost=0.060)
    assert sum(chosen[-1000:]) / 1000 > 0.5

    cheap_joins = ChainSteps("auto", 3, "--minedraft-steps")
    chosen, rate = serve_turning_over(cheap_joins, join_cost=0.0)
    _, plain = serve_turning_over(ChainSteps("off", 3, "--minedraft-steps"), join_cost=0.0)
    assert sum(chosen[-1000:]) / 1000 > 1.5
    assert rate > 1.2 * plain


def test_a_prefill_is_left_out_of_the_decode_step_before_it(monkeypatch) -> None:
    """Our workers time a decode step up to the next one (MINEDRAFT's chain across batch
    changes); a prefill run between them costs the same whatever setting the steps ran, so it
    is left out of the step it follows -- where a controller times steps at all."""
    from types import SimpleNamespace

    from sgl_spec.common import worker as worker_module

    now = [10.0]
    monkeypatch.setattr(worker_module.time, "perf_counter", lambda: now[0])

    class Worker(worker_module.TargetWrappingWorker):
        name = "TEST"

        def forward_prefill(self, batch: object) -> str:
            now[0] += 0.5
            return "prefilled"

    worker = Worker.__new__(Worker)
    worker._target_worker = None
    worker._clock = StepClock()
    worker.controller = steps_controller(3)
    worker._clock.tick(("a",), 10.0)
    worker._clock.chosen(2, 1)
    extend = SimpleNamespace(forward_mode=SimpleNamespace(is_extend=lambda: True))
    assert worker.forward_batch_generation(extend) == "prefilled"
    assert worker._clock.tick(("a", "b"), 10.7, across_changes=True) == (2, 1, pytest.approx(0.2))
    worker.controller = None  # no controller (a fixed setting): nothing timed, nothing left out
    worker._clock.tick(("a",), 11.0)
    worker.forward_batch_generation(extend)
    assert worker._clock.last_key == ("a",) and worker._clock._last[0] == 11.0
