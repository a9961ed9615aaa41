"""STANDALONE_FULL's ``--standalone-steps``: the policy SGLang's adaptive controller asks for
each step's chain length (``standalone/control.py``) and the draft's deferred tokens read back
in one forward (``standalone/catch_up.py``). No server: the e2e side is
``tests/e2e/test_lossless_standalone.py`` (``chain_cycle`` and ``chain_identity_cycle``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sgl_spec.standalone import catch_up
from sgl_spec.standalone.control import StepsPolicy


def test_cycle_takes_every_length_in_turn() -> None:
    policy = StepsPolicy("cycle", 3)
    assert policy.candidate_steps == [1, 2, 3]  # 0: a plain step, no SGLang state
    chosen = [policy.choose(batch_size=4, ctx_len=100) for _ in range(9)]
    assert chosen == [0, 1, 2, 3, 0, 1, 2, 3, 0]


def test_a_plain_step_leaves_sglangs_state_as_it_was() -> None:
    """SGLang asks for the length of each step it runs (1 or more); a step at 0 drafts runs
    without it, and should SGLang ask then (an idle batch), it gets the state active before,
    never 0 (no state for it)."""
    policy = StepsPolicy("cycle", 3)
    assert policy.get_steps_for_batch(1) == 3  # the launch's state
    for expected_active in (3, 1, 2, 3, 3, 1):
        k = policy.choose(1, 10)
        if k:  # SGLang's forward runs and activates k
            assert policy.get_steps_for_batch(1) == k
        assert policy.get_steps_for_batch(1) == expected_active


def test_off_never_drafts_and_needs_one_state() -> None:
    policy = StepsPolicy("off", 5)
    assert policy.candidate_steps == [5]  # the launch's state, which SGLang registers first
    assert {policy.choose(1, 10) for _ in range(20)} == {0}


@pytest.mark.parametrize(("mode", "steps"), [("fixed", 3), ("sometimes", 3), ("auto", 0)])
def test_bad_policy_settings_are_refused(mode: str, steps: int) -> None:
    with pytest.raises(ValueError, match="--standalone-steps"):
        StepsPolicy(mode, steps)


def test_auto_times_the_steps_after_a_switch_without_the_draft_models_catch_up() -> None:
    """STANDALONE's first drafted step after plain ones runs the deferred draft forwards, a
    one-off cost of switching on that grows with the wait: its controller times every step, that
    one less its catch-up, and so holds probes to plausible payers like the others; MINEDRAFT's
    (the draft server kept caught up while plain) times only steps after their own setting."""
    from sgl_spec.control.chain_steps import ChainSteps

    assert StepsPolicy("auto", 3).controller.config.steady_times is False
    assert ChainSteps("auto", 3, "--minedraft-steps").controller.config.steady_times is True
    assert StepsPolicy("auto", 3).controller.config.plausible_probes is True
    assert ChainSteps("auto", 3, "--minedraft-steps").controller.config.plausible_probes is True


def test_a_drafted_steps_catch_up_is_left_out_of_its_time(monkeypatch) -> None:
    """The seconds the draft spent catching up are taken off the step's measured time and
    counted as the switch's cost; a plain step and a step without catch-up are timed whole; a
    prefill between two decode steps is left out of the one before it."""
    from sgl_spec.control.step_times import StepClock
    from sgl_spec.standalone import control

    monkeypatch.setattr(
        control.standalone_worker_v2.StandaloneWorkerV2,
        "forward_batch_generation",
        lambda self, batch, *a, **k: "drafted",
    )
    worker = control.ControlledStandaloneWorker.__new__(control.ControlledStandaloneWorker)
    worker.policy = StepsPolicy("auto", 3)
    worker._clock = StepClock()
    worker._draft_worker = SimpleNamespace(catch_up_s=0.25)
    switched: list[float] = []
    monkeypatch.setattr(worker.policy.controller.prices, "switched", switched.append)
    monkeypatch.setattr(worker, "_plain_step", lambda batch: "plain")
    mode = SimpleNamespace(is_extend=lambda: False, is_idle=lambda: False)
    batch = SimpleNamespace(forward_mode=mode, is_extend_in_batch=False, reqs=[object()])

    def step(k: int, start: float) -> str:
        def choose(batch: object) -> int:
            worker._clock.tick(("r",), start)
            worker._clock.chosen(k, 1)
            return k

        monkeypatch.setattr(worker, "_choose", choose)
        return worker.forward_batch_generation(batch)

    assert step(0, 10.0) == "plain"
    assert worker._clock._last[0] == 10.0 and not switched  # a plain step: timed whole
    assert step(2, 11.0) == "drafted"
    assert worker._clock._last[0] == pytest.approx(11.25) and switched == [0.25]
    worker._draft_worker.catch_up_s = 0.0
    assert step(2, 12.0) == "drafted"
    assert worker._clock._last[0] == 12.0 and switched == [0.25]
    # a prefill after it: each request's once whatever the lengths, left out of that step
    now = [100.0]
    monkeypatch.setattr(control.time, "perf_counter", lambda: now[0])

    def prefill(self, batch, *args, **kwargs) -> str:
        now[0] += 0.5
        return "prefilled"

    monkeypatch.setattr(
        control.standalone_worker_v2.StandaloneWorkerV2, "forward_batch_generation", prefill
    )
    extend_mode = SimpleNamespace(is_extend=lambda: True, is_idle=lambda: False)
    extend = SimpleNamespace(forward_mode=extend_mode, is_extend_in_batch=True, reqs=[object()])
    assert worker.forward_batch_generation(extend) == "prefilled"
    assert worker._clock._last[0] == pytest.approx(12.5) and switched == [0.25]


def test_auto_measures_plain_steps_first_then_follows_acceptance_and_cost() -> None:
    """The controller warms up and measures T(0) at 0 drafts, then probes the chain lengths
    and keeps the one whose measured tokens per second is best; acceptance comes from SGLang's
    per-request verify results."""
    policy = StepsPolicy("auto", 3)
    controller = policy.controller
    assert controller is not None and controller.config.probe_on_turnover
    # step time: 10 ms plain, +1 ms per draft; every draft accepted
    seconds = {0: 0.010, 1: 0.011, 2: 0.012, 3: 0.013}
    history = []
    for _ in range(200):
        k = policy.choose(batch_size=2, ctx_len=64)
        assert policy.steps == k
        history.append(k)
        policy.on_verify_complete([k, k], batch_size=2)
        controller.observe_step(k, 2, seconds[k])
    assert set(history[: controller.config.warmup_steps]) == {0}
    assert history[-20:].count(3) >= 15, history[-20:]
    assert policy.lam > 3.0


def test_auto_stays_off_when_drafts_are_rejected() -> None:
    policy = StepsPolicy("auto", 3)
    controller = policy.controller
    history = []
    for _ in range(300):
        k = policy.choose(batch_size=8, ctx_len=64)
        history.append(k)
        policy.on_verify_complete([0] * 8, batch_size=8)
        controller.observe_step(k, 8, 0.010 * (1 + 0.3 * k))
    assert history[-100:].count(0) >= 90, history[-100:]


def _reqs(n: int) -> list[SimpleNamespace]:
    return [SimpleNamespace(rid=str(i)) for i in range(n)]


def test_deferred_tokens_accumulate_per_request() -> None:
    reqs = _reqs(2)
    assert not catch_up.any_pending(reqs)
    catch_up.mark_fresh(reqs[0])  # out of prefill: its bonus token only
    assert catch_up.any_pending(reqs) and not catch_up.any_behind(reqs)
    catch_up.defer(reqs, torch.tensor([10, 20]))  # a step without drafts
    # request 0 committed its old bonus (10) unread; request 1 lacks only its new bonus
    assert [int(t) for t in catch_up.pending(reqs[0])] == [10]
    assert catch_up.pending(reqs[1]) == []
    catch_up.defer(reqs, torch.tensor([11, 21]))
    assert [int(t) for t in catch_up.pending(reqs[0])] == [10, 11]
    assert [int(t) for t in catch_up.pending(reqs[1])] == [21]
    assert catch_up.any_behind(reqs) and not catch_up.over_limit(reqs)
    for i in range(catch_up.CATCH_UP_LIMIT - 2):
        catch_up.defer(reqs, torch.tensor([100 + i, 200 + i]))
    assert catch_up.over_limit(reqs)


class _Runner:
    """What ``catch_up_forward`` uses of the draft's ModelRunner; records the forward."""

    def __init__(self, req_to_token: torch.Tensor, vocab: int) -> None:
        self.req_to_token_pool = SimpleNamespace(req_to_token=req_to_token)
        self.kv_index_translator = SimpleNamespace(bind_own_plan=lambda fb: None)
        self.spec_algorithm = None
        self.vocab = vocab
        self.batch = None

    def forward(self, forward_batch):
        self.batch = forward_batch
        bs = forward_batch.batch_size
        logits = torch.arange(bs * self.vocab, dtype=torch.float32).view(bs, self.vocab)
        return SimpleNamespace(logits_output=SimpleNamespace(next_token_logits=logits))


def test_catch_up_reads_each_requests_tokens_at_their_positions() -> None:
    """One EXTEND: request 0 reads its two deferred tokens and its bonus at positions 5-7,
    request 1 (up to date) its bonus again at 9; KV slots come from req_to_token."""
    req_to_token = torch.arange(4 * 16, dtype=torch.int32).view(4, 16) + 1000
    reqs = _reqs(2)
    catch_up.mark_fresh(reqs[0])
    catch_up.pending(reqs[0]).extend([torch.tensor(41), torch.tensor(42)])
    runner = _Runner(req_to_token, vocab=8)
    pool = torch.tensor([2, 0])
    logits = catch_up.catch_up_forward(
        runner, reqs, pool, [7, 9], torch.tensor([43, 90]), sampling_info=None
    )
    fb = runner.batch
    assert fb.forward_mode.is_extend()
    assert fb.input_ids.tolist() == [41, 42, 43, 90]
    assert fb.positions.tolist() == [5, 6, 7, 9]
    assert fb.out_cache_loc.tolist() == [
        int(req_to_token[2, 5]), int(req_to_token[2, 6]), int(req_to_token[2, 7]),
        int(req_to_token[0, 9]),
    ]  # fmt: skip
    assert fb.extend_seq_lens_cpu == [3, 1] and fb.extend_prefix_lens_cpu == [5, 9]
    assert fb.extend_start_loc.tolist() == [0, 3]
    assert fb.seq_lens.tolist() == [8, 10] and fb.seq_lens_sum == 18
    assert logits.shape == (2, 8)
    assert not catch_up.any_pending(reqs)  # every request caught up


def test_auto_relearns_deep_positions_after_a_poor_request() -> None:
    """A request whose drafts fail from position 2 on drags α_2, α_3 down and the controller
    settles at 1 draft, where positions 2-3 are never verified; probing the other lengths now
    and then while speculating lets a later request of full acceptance bring back 3."""
    policy = StepsPolicy("auto", 3)
    controller = policy.controller
    seconds = {0: 0.010, 1: 0.0115, 2: 0.013, 3: 0.0145}
    history = []
    for step in range(1200):
        k = policy.choose(batch_size=1, ctx_len=64)
        history.append(k)
        poor = 100 <= step < 300
        policy.on_verify_complete([min(k, 1) if poor else k], batch_size=1)
        controller.observe_step(k, 1, seconds[k])
    assert history[280:300].count(1) >= 15, history[280:300]  # settled at 1 on the poor one
    assert history[-50:].count(3) >= 40, history[-50:]


def test_a_new_request_is_expected_to_accept_like_the_population() -> None:
    """At one request, a request whose drafts are all rejected turns drafting off; the next one
    (the batch turned over) must not inherit its acceptance: renewed toward the population's
    estimate on turnover, α lets its probe switch drafting back on, and a request whose drafts
    are all accepted drafts on most of its steps."""
    from sgl_spec.control.chain_steps import steps_controller

    controller = steps_controller(3)
    seconds = {0: 0.010, 1: 0.0133, 2: 0.0166, 3: 0.0199}  # a draft costs a third of a decode
    drafting = []
    for request in range(12):
        poor = request % 3 == 2  # every third request rejects every draft
        controller.batch_changed(1, 1)
        committed, steps_on, steps = 0, 0, 0
        while committed < 128:
            k = controller.decide(1, 64).k
            accepted = 0 if poor else k
            if k:
                controller.observe(k, [accepted])
            controller.observe_step(k, 1, seconds[k])
            committed += accepted + 1
            steps_on += k > 0
            steps += 1
        drafting.append(steps_on / steps)
    after_poor = [drafting[r] for r in (3, 6, 9)]  # full-acceptance requests right after
    assert min(after_poor) >= 0.8, drafting
    assert max(drafting[r] for r in (5, 8, 11)) <= 0.5, drafting  # the poor ones turn it off


def test_renewal_waits_for_the_population_estimate() -> None:
    """The first request's few probes are not a population: until a position has been observed
    POPULATION_MIN_SEEN times, a new request keeps the running α (no pull toward the prior)."""
    from sgl_spec.control.acceptance import POPULATION_MIN_SEEN, ChainAcceptance

    model = ChainAcceptance([0.5, 0.5, 0.5], weight=0.05)
    for _ in range(POPULATION_MIN_SEEN - 1):
        model.observe(3, [3])
    before = list(model.alphas)
    model.renew(1.0)
    assert model.alphas == before
    model.observe(3, [3])
    assert min(model.population) > 0.99  # a running mean, not an EWMA from the 0.5 prior
    model.alphas = [0.2, 0.2, 0.2]  # a rejecting request left α low
    model.renew(0.5)
    assert all(abs(a - 0.6) < 0.01 for a in model.alphas), model.alphas
