"""SPECBLOCK reads a prefill's prompts through its drafter at once only where the decode step
after it is expected to draft (``SpecBlockWorker._drafts_next``); else they stay unread, kept
per KV location, until a step drafts for them (``test_specblock_target_rows.py`` shows the
late read leaves the drafter where the early one would). bench_serving's one warm-up request
drafts at one request, and the wave of 32 after it runs without drafts: reading its prompts at
the prefill was the drafter's whole cost at that load."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from sgl_spec.control.budget import budget_controller
from sgl_spec.control.ranks import RankZeroDecides
from sgl_spec.specblock.worker import SpecBlockWorker

BUDGETS = (1, 2, 4, 8)
MAX_DRAFTS = (0, 1, 3, 7)


def _measured(step_ms: dict[int, dict[int, float]]):
    """A budget controller past its warm-up whose step times at each batch size are
    ``step_ms[bs][k]``."""
    ctrl = budget_controller(BUDGETS, MAX_DRAFTS)
    ctrl.num_steps_seen = ctrl.config.warmup_steps
    for bs, times in step_ms.items():
        for k, ms in times.items():
            for _ in range(ctrl.times.window):
                ctrl.times.update(bs, k, ms / 1e3)
    for _ in range(40):  # every request accepts about two drafts of any budget > 1 node
        ctrl.observe_settings({1: [1, 1], 2: [2, 2], 3: [2, 2]})
    return ctrl


def _worker(controller, last_budget: int = 8, last_batch_size: int = 1):
    return SimpleNamespace(
        controller=controller, _last_budget=last_budget, _last_batch_size=last_batch_size
    )


def _drafts_next(worker, num_new: int) -> bool:
    return SpecBlockWorker._drafts_next(worker, num_new, torch.full((num_new,), 128))


def test_prompts_are_read_where_the_next_step_drafts() -> None:
    # one request: a tree of 8 nodes costs 1.3 plain steps; 32: it costs 6
    ctrl = _measured({1: {0: 10, 1: 11, 2: 12, 3: 13}, 32: {0: 40, 1: 120, 2: 180, 3: 240}})
    assert ctrl.best(1, 128).k > 0 and ctrl.best(32, 128).k == 0
    assert _drafts_next(_worker(ctrl, last_batch_size=1), 1)  # the next request at c = 1
    assert not _drafts_next(_worker(ctrl, last_batch_size=1), 32)  # the wave after a warm-up
    assert not _drafts_next(_worker(ctrl, last_batch_size=32), 1)  # one joins 31 running
    assert not _drafts_next(_worker(ctrl, last_budget=1), 1)  # the last step did not draft


def test_without_a_lone_controller_the_last_step_decides() -> None:
    assert _drafts_next(_worker(None), 32)  # a fixed budget drafts every step
    assert not _drafts_next(_worker(None, last_budget=1), 32)  # budget "off"
    ctrl = SimpleNamespace(expects_drafts=lambda *args: False)
    assert _drafts_next(_worker(RankZeroDecides(ctrl, group=None)), 32)  # rank 0 decides for all
    assert not _drafts_next(_worker(ctrl), 32)  # a lone controller (guarded or not) is asked


def test_a_batch_whose_plain_step_is_unmeasured_reads_no_prompts() -> None:
    # the first wave of 32 after warm-up requests that drafted: its bucket's first steps run
    # plain to measure T(0) (calibration), so its prompts are read later, if ever
    ctrl = _measured({1: {0: 10, 1: 11, 2: 12, 3: 13}})
    assert ctrl.best(32, 128).k > 0  # the prior alone would draft there
    assert not _drafts_next(_worker(ctrl, last_batch_size=1), 32)
    assert _drafts_next(_worker(ctrl, last_batch_size=1), 1)
    for _ in range(ctrl.times.window):  # T(0) at 32 measured: the bound decides again
        ctrl.times.update(32, 0, 0.040)
    assert _drafts_next(_worker(ctrl, last_batch_size=1), 32) == (ctrl.best(32, 128).k > 0)


def test_expects_drafts_changes_no_state() -> None:
    ctrl = _measured({1: {0: 10, 1: 11, 2: 12, 3: 13}, 32: {0: 40}})
    before = (ctrl._probe, ctrl._since_probe, ctrl.num_steps_off, ctrl.num_steps_on)
    for bs in (1, 4, 32):
        ctrl.expects_drafts(bs, 128)
    assert (ctrl._probe, ctrl._since_probe, ctrl.num_steps_off, ctrl.num_steps_on) == before


def test_steps_without_the_drafter_wait_for_a_measured_drafting_step() -> None:
    # at 32 requests drafting is priced from a bound (T(k) measured at one request only): the
    # n-gram trees alone are not verified there until the controller's probes have measured a
    # drafting step at that batch; its probes then run back to back, not between such steps
    ctrl = _measured({1: {0: 10, 1: 11, 2: 12, 3: 13}, 32: {0: 40}})
    asked = []
    ngram = SimpleNamespace(plan=lambda reqs, may_skip: asked.append(may_skip) or may_skip)
    worker = SimpleNamespace(controller=ctrl, ngram=ngram)
    best = ctrl.best(32, 128)
    assert best.k > 0 and best.source == "bound" and ctrl.expects_drafts(32, 128)
    assert not SpecBlockWorker._plan_alone(worker, [None] * 32, [128] * 32)
    assert SpecBlockWorker._plan_alone(worker, [None], [128])  # measured at one request
    for _ in range(ctrl.times.window):  # drafting measured at 32: paying, as at one request
        ctrl.times.update(32, best.k, 0.041)
    assert ctrl.best(32, 128).source == "measured"
    assert SpecBlockWorker._plan_alone(worker, [None] * 32, [128] * 32)
    assert asked == [False, True, True]
