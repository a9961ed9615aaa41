"""SPECBLOCK cost-aware adaptation without a server (paper §3.4, Algorithm 1, App. A.3): the
signal, the epsilon schedule, the bandit's choice, warm-up, measurement and EWMA revision, the
drift guard's rollback, the KL-penalised update on two drafter copies, and the serving glue's
query tracking on constructed verify outcomes."""

from __future__ import annotations

import math
import os
import threading

import pytest
import torch

from sgl_spec.config import ConfigError, split_argv
from sgl_spec.specblock.adapt.policy import (
    Action,
    AdaptConfig,
    CostAwareBandit,
    DriftGuard,
    Mark,
    UpdateBuffer,
    epsilon,
    ewma,
    rejection_signal,
)
from sgl_spec.specblock.adapt.serving import OnlineAdapter, _Query, rejected_prob
from sgl_spec.specblock.adapt.update import (
    BackgroundTrainer,
    DrafterCopies,
    TrainExample,
    adapt_loss,
    cut_windows,
)
from sgl_spec.specblock.drafting import DraftSettings, PrefixContext, grow_trees
from sgl_spec.specblock.training.losses import target_to_draft_map
from tests.helpers.tiny_models import SPECBLOCK_D, SPECBLOCK_K, SPECBLOCK_V, specblock_drafter

torch.set_num_threads(1)
K, D, V = SPECBLOCK_K, SPECBLOCK_D, SPECBLOCK_V

# ---- signal, schedule, EWMA -------------------------------------------------------------------


def test_rejection_signal_is_eq8():
    assert rejection_signal([]) == 0.0
    assert rejection_signal([1.0, 1.0]) == 0.0
    assert math.isclose(rejection_signal([0.25, 0.0, 0.9]), 0.75 + 1.0 + 0.1)
    with pytest.raises(ValueError, match="probability"):
        rejection_signal([1.5])


def test_epsilon_decays_linearly_over_the_cold_start():
    cfg = AdaptConfig()
    values = [epsilon(e, cfg) for e in range(10)]
    assert math.isclose(values[0], 0.30) and math.isclose(values[7], 0.10)
    steps = [a - b for a, b in zip(values[:7], values[1:8], strict=True)]
    assert all(math.isclose(s, 0.2 / 7) for s in steps)
    assert values[8] == values[9] == 0.0


def test_ewma_is_eq10():
    assert math.isclose(ewma(1.0, 3.0, 0.1), 0.9 + 0.3)
    assert ewma(2.0, 2.0, 0.5) == 2.0


def test_adapt_options_parse_and_flags_are_validated():
    cfg = AdaptConfig.parse("warmup_queries=2,lr=1e-3")
    assert cfg.warmup_queries == 2 and cfg.lr == 1e-3 and cfg.s_min == 5.0
    assert AdaptConfig() == AdaptConfig.parse(None)
    with pytest.raises(ValueError, match="unknown adapt option"):
        AdaptConfig.parse("warmup=2")
    with pytest.raises(ValueError, match="eps_end"):
        AdaptConfig(eps_start=0.1, eps_end=0.3)
    config, _ = split_argv(["--specblock-adapt", "--specblock-adapt-options", "window=4"])
    assert config.specblock_adapt and config.specblock_adapt_options == "window=4"
    assert not split_argv([])[0].specblock_adapt
    with pytest.raises(ConfigError, match="--specblock-adapt-options needs --specblock-adapt"):
        split_argv(["--specblock-adapt-options", "window=4"])
    with pytest.raises(ConfigError, match="--specblock-adapt-options"):
        split_argv(["--specblock-adapt", "--specblock-adapt-options", "window=0"])


# ---- bandit -----------------------------------------------------------------------------------


class Clock:
    """Fake server marks: ``rate`` tokens per second from now on."""

    def __init__(self) -> None:
        self.t, self.tokens = 0.0, 0

    def tick(self, rate: float, seconds: float = 1.0) -> Mark:
        self.t += seconds
        self.tokens += int(rate * seconds)
        return Mark(self.t, self.tokens)


def _cfg(**kw: float) -> AdaptConfig:
    base = dict(
        warmup_queries=2,
        cold_start_events=0,
        eps_start=0.0,
        eps_end=0.0,
        cooldown_queries=0,
        measure_queries=2,
        buffer_queries=1,
    )
    base.update(kw)
    return AdaptConfig(**base)  # type: ignore[arg-type]


def test_warmup_skips_and_measures_the_baseline():
    bandit: CostAwareBandit[int] = CostAwareBandit(_cfg(warmup_queries=3, cold_start_events=8))
    clock = Clock()
    for _ in range(3):
        decision = bandit.end_query(50.0, 2.0, clock.tick(10.0), [1])
        assert decision.action is Action.SKIP and decision.trigger is None
    assert bandit.baseline_tp == pytest.approx(10.0)  # 20 tokens over 2 s after the first mark
    decision = bandit.end_query(50.0, 2.0, clock.tick(10.0), [1])
    assert decision.action is Action.HEAD  # cold start: unseeded HEAD is tried first
    assert bandit.counts[Action.SKIP] == 3 and bandit.counts[Action.HEAD] == 1


def test_choice_is_eq9_after_the_cold_start():
    bandit: CostAwareBandit[int] = CostAwareBandit(_cfg())
    bandit.values = {Action.HEAD: 0.5, Action.FULL: 0.8}
    assert bandit.choose(2.0)[0] is Action.FULL
    assert bandit.choose(2.0)[1] == {Action.HEAD: 1.0, Action.FULL: 1.6}
    bandit.values = {Action.HEAD: 0.5, Action.FULL: -0.8}
    assert bandit.choose(2.0)[0] is Action.HEAD
    bandit.values = {Action.HEAD: 0.0, Action.FULL: -0.1}
    assert bandit.choose(9.0)[0] is Action.SKIP  # both predictions <= 0
    bandit.values = {Action.HEAD: 1.0, Action.FULL: 1.0}
    assert bandit.choose(0.0)[0] is Action.SKIP  # nothing rejected


def test_cold_start_explores_with_epsilon():
    cfg = _cfg(cold_start_events=8, eps_start=1.0, eps_end=1.0)
    bandit: CostAwareBandit[int] = CostAwareBandit(cfg)
    picks = {bandit.choose(3.0)[0] for _ in range(64)}
    assert picks == {Action.HEAD, Action.FULL}  # (1/2)^63 chance of one missing
    assert all(bandit.choose(3.0)[2] for _ in range(8))  # flagged as explored


def _run_update(bandit: CostAwareBandit[int], clock: Clock, signal: float, after: float) -> None:
    """Warm-up at 10 tok/s, one triggering query, sync, then the interval at ``after`` tok/s."""
    while bandit.num_queries < bandit.cfg.warmup_queries:
        bandit.end_query(signal, 2.0, clock.tick(10.0), [1])
    decision = bandit.end_query(signal, 2.0, clock.tick(10.0), [7])
    assert decision.trigger is not None and decision.trigger.examples == [7]
    assert decision.trigger.signal == signal
    bandit.on_synced(Mark(clock.t, clock.tokens))
    for _ in range(bandit.cfg.measure_queries):
        assert bandit.measuring
        bandit.end_query(0.0, 2.0, clock.tick(after), [])


def test_measured_throughput_change_revises_the_value():
    bandit: CostAwareBandit[int] = CostAwareBandit(_cfg())
    bandit.values[Action.HEAD] = 0.01
    _run_update(bandit, Clock(), signal=10.0, after=20.0)
    # reference 10 tok/s, observed 20 tok/s: reward (20 - 10) / 10 = 1
    assert bandit.values[Action.HEAD] == pytest.approx(0.9 * 0.01 + 0.1 * 1.0)
    assert not bandit.measuring and bandit.num_updates == 1
    assert "adapt_updates=1" in bandit.summary() and "adapt_skip/head/full=" in bandit.summary()


def test_low_trigger_signal_skips_the_revision():
    bandit: CostAwareBandit[int] = CostAwareBandit(_cfg())
    bandit.values[Action.HEAD] = 0.01
    _run_update(bandit, Clock(), signal=4.0, after=20.0)  # s_trig < s_min = 5
    assert bandit.values[Action.HEAD] == 0.01


def test_no_new_trigger_while_training_or_measuring():
    bandit: CostAwareBandit[int] = CostAwareBandit(_cfg(measure_queries=3))
    bandit.values[Action.HEAD] = 1.0
    clock = Clock()
    for _ in range(2):
        bandit.end_query(6.0, 2.0, clock.tick(10.0), [1])
    assert bandit.end_query(6.0, 2.0, clock.tick(10.0), [1]).trigger is not None
    assert bandit.end_query(6.0, 2.0, clock.tick(10.0), [1]).trigger is None  # training
    bandit.on_synced(Mark(clock.t, clock.tokens))
    for _ in range(2):
        assert bandit.end_query(6.0, 2.0, clock.tick(10.0), [1]).trigger is None  # measuring
    assert bandit.end_query(6.0, 2.0, clock.tick(10.0), [1]).trigger is not None  # closed


def test_cooldown_blocks_two_queries_after_a_train_event():
    bandit: CostAwareBandit[int] = CostAwareBandit(_cfg(measure_queries=1, cooldown_queries=2))
    bandit.values[Action.HEAD] = 1.0
    clock = Clock()
    for _ in range(2):
        bandit.end_query(6.0, 2.0, clock.tick(10.0), [1])
    assert bandit.end_query(6.0, 2.0, clock.tick(10.0), [1]).trigger is not None
    bandit.on_synced(Mark(clock.t, clock.tokens))
    triggers = [bandit.end_query(6.0, 2.0, clock.tick(10.0), [1]).trigger for _ in range(3)]
    assert [t is not None for t in triggers] == [False, False, True]


def test_rollback_after_three_successive_acceptance_drops():
    bandit: CostAwareBandit[int] = CostAwareBandit(_cfg(measure_queries=1))
    bandit.values[Action.HEAD] = 1.0
    clock = Clock()
    for _ in range(2):
        bandit.end_query(6.0, 3.0, clock.tick(10.0), [1])  # warm-up tau 3.0
    decisions = []
    for tau in (2.5, 2.6, 2.4, 2.2, 2.0):  # drop, rise, drop, drop, drop
        bandit.values[Action.HEAD] = max(bandit.values[Action.HEAD], 1.0)
        assert bandit.end_query(6.0, 2.0, clock.tick(10.0), [1]).trigger is not None
        bandit.on_synced(Mark(clock.t, clock.tokens))
        decisions.append(bandit.end_query(0.0, tau, clock.tick(10.0), []))
    assert [d.rollback for d in decisions] == [False, False, False, False, True]
    assert [d.good for d in decisions] == [False, True, False, False, False]
    assert bandit.num_rollbacks == 1 and bandit.values[Action.HEAD] == 0.0
    assert bandit.num_events == 0  # back to the cold start


def test_update_buffer_saturates_and_keeps_the_newest():
    buffer: UpdateBuffer[int] = UpdateBuffer(2, max_examples=3)
    buffer.push([1, 2])
    assert not buffer.saturated
    buffer.push([3, 4])
    assert buffer.saturated and buffer.examples == [2, 3, 4]
    assert buffer.drain() == [2, 3, 4] and not buffer.saturated and buffer.examples == []


def test_drift_guard():
    guard = DriftGuard(3)
    assert not any(guard.observe(x) for x in (3.0, 2.0, 1.0))  # two drops
    assert guard.observe(0.5)
    assert not guard.observe(0.4)  # the run restarted
    assert not DriftGuard(0).observe(1.0)


# ---- training copies ------------------------------------------------------------------------


def _examples(n: int, window: int = 6, seed: int = 0) -> list[TrainExample]:
    gen = torch.Generator().manual_seed(seed)
    base = torch.randint(0, V, (window + K,), generator=gen)
    out = []
    for _ in range(n):  # one repeated pattern: learnable in a few steps
        out.append(TrainExample(torch.randn(window + K, 3 * D, generator=gen), base, window))
    return out


def _params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.named_parameters()}


def test_kl_penalised_update_reduces_loss_and_leaves_theta_inf_until_synced():
    drafter = specblock_drafter(seed=2)
    before_inf = _params(drafter)
    copies = DrafterCopies(drafter, AdaptConfig(lr=1e-2, steps_per_update=6, kl_weight=0.01))
    examples = _examples(4)
    start = adapt_loss(copies.train, copies.ref, examples, 0.01)
    assert float(start.kl.detach()) == pytest.approx(0.0, abs=1e-6)  # theta_train == theta_0
    copies.update(Action.FULL, examples)
    end = adapt_loss(copies.train, copies.ref, examples, 0.01)
    assert float(end.total.detach()) < float(start.total.detach()) - 0.1
    assert float(end.kl.detach()) > 0.0
    for name, value in _params(drafter).items():
        torch.testing.assert_close(value, before_inf[name])  # theta_inf untouched
    assert copies.ready and copies.sync()
    assert not copies.ready and not copies.sync()
    trained = dict(copies.train.named_parameters())
    for name, value in drafter.named_parameters():
        torch.testing.assert_close(value, trained[name].to(value.dtype))
    assert not torch.equal(drafter.lm_head.weight, before_inf["lm_head.weight"])


def test_head_update_leaves_the_trunk_and_rollback_restores():
    drafter = specblock_drafter(seed=3)
    copies = DrafterCopies(drafter, AdaptConfig(lr=1e-2, steps_per_update=2))
    before = _params(copies.train)
    copies.update(Action.HEAD, _examples(2))
    after = _params(copies.train)
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed and all(n.split(".")[0] in ("lm_head", "rank_head") for n in changed)
    assert copies.sync() and not torch.equal(drafter.lm_head.weight, before["lm_head.weight"])
    copies.roll_back()  # to the last good weights: the pre-deployment ones
    for module in (drafter, copies.train):
        for name, value in _params(module).items():
            torch.testing.assert_close(value, before[name].to(value.dtype))


def test_background_trainer_runs_updates_off_the_calling_thread():
    copies = DrafterCopies(specblock_drafter(seed=4), AdaptConfig(steps_per_update=1))
    trainer = BackgroundTrainer(copies)
    trainer.submit(Action.HEAD, _examples(2))
    action, loss = trainer.results.get(timeout=120)
    trainer.close()
    assert action is Action.HEAD and loss is not None and copies.version == 1
    with pytest.raises(ValueError, match="num_starts"):
        TrainExample(torch.zeros(4, 3 * D), torch.zeros(4, dtype=torch.long), 4)


def test_failed_update_is_discarded_whole_and_a_later_one_applies(monkeypatch):
    """The trainer raising mid-update (after its first optimizer step) leaves theta_train as
    theta_inf was, publishes nothing, and the next update trains and syncs as usual."""
    from sgl_spec.specblock.adapt import update as update_module

    drafter = specblock_drafter(seed=6)
    serving = _params(drafter)
    copies = DrafterCopies(drafter, AdaptConfig(lr=1e-2, steps_per_update=2))
    calls = []

    def second_step_fails(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected")
        return adapt_loss(*args, **kwargs)

    monkeypatch.setattr(update_module, "adapt_loss", second_step_fails)
    with pytest.raises(RuntimeError, match="injected"):
        copies.update(Action.FULL, _examples(2))
    assert len(calls) == 2 and copies.version == 0 and not copies.sync()
    for name, value in _params(copies.train).items():
        torch.testing.assert_close(value, serving[name].to(value.dtype))
    monkeypatch.setattr(update_module, "adapt_loss", adapt_loss)
    copies.update(Action.FULL, _examples(2))
    assert copies.sync() and not torch.equal(drafter.lm_head.weight, serving["lm_head.weight"])


@pytest.mark.parametrize("steps", [1, 2])
def test_diverging_update_raises_and_never_reaches_theta_inf(steps: int):
    """An infinite step size turns theta_train non-finite in one step: the update fails and is
    discarded instead of being synced (a NaN drafter would draft noise from then on)."""
    drafter = specblock_drafter(seed=7)
    copies = DrafterCopies(drafter, AdaptConfig(lr=float("inf"), steps_per_update=steps))
    with pytest.raises(FloatingPointError, match="non-finite"):
        copies.update(Action.HEAD, _examples(2))
    assert not copies.ready
    assert all(torch.isfinite(v).all() for v in _params(copies.train).values())


def test_adaptation_turns_off_after_failed_updates_in_a_row(caplog):
    from sgl_spec.specblock.adapt.serving import MAX_FAILED_UPDATES

    adapter = OnlineAdapter(specblock_drafter(seed=8), _cfg())
    adapter.trainer.results.put((Action.HEAD, None))
    adapter.trainer.results.put((Action.HEAD, 0.5))  # a success resets the count
    for _ in range(MAX_FAILED_UPDATES - 1):
        adapter.trainer.results.put((Action.FULL, None))
    adapter.before_draft(now=1.0)
    assert adapter.enabled and adapter.num_failed == MAX_FAILED_UPDATES - 1
    adapter.trainer.results.put((Action.FULL, None))
    with caplog.at_level("WARNING"):
        adapter.before_draft(now=2.0)
    assert not adapter.enabled and not adapter.trainer.thread.is_alive()
    assert "adaptation off" in caplog.text
    adapter.after_verify([1], [10], [], [], [], [[0]], torch.zeros(1, 1), torch.zeros(1, 1, 1), [0])
    assert not adapter.queries  # no longer observed
    adapter.close()


def _append_num_threads(out: list[int]) -> None:
    out.append(torch.get_num_threads())


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="no per-thread niceness")
def test_cpu_trainer_thread_runs_single_threaded_at_lowered_priority(caplog):
    """Serving keeps the cores: the training thread runs one intra-op thread and
    ``trainer_nice`` above the serving thread's niceness (0 leaves the niceness alone), and
    logs both; the serving thread keeps its own thread count and niceness."""
    caplog.set_level("INFO", logger="sgl_spec.specblock.adapt.update")
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    torch.set_num_threads(2)
    try:
        for nice, want in ((7, min(mine + 7, 19)), (0, mine)):
            copies = DrafterCopies(specblock_drafter(seed=4), AdaptConfig(trainer_nice=nice))
            trainer = BackgroundTrainer(copies)
            assert trainer.started.wait(30)
            assert os.getpriority(os.PRIO_PROCESS, trainer.thread.native_id) == want
            assert trainer.num_threads == 1
            seen: list[int] = []  # a thread started later keeps the default, not the trainer's 1
            later = threading.Thread(target=_append_num_threads, args=(seen,))
            later.start()
            later.join()
            assert seen == [2]
            assert f"cpu, 1 intra-op thread(s), niceness {want}" in caplog.text
            trainer.close()
            caplog.clear()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(1)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine
    with pytest.raises(ValueError, match="trainer_nice"):
        AdaptConfig(trainer_nice=20)


# ---- serving glue -----------------------------------------------------------------------------


def _drafted(model, bs: int = 2):
    cfg = model.config.llama_config()
    head_dim = getattr(cfg, "head_dim", None) or D // cfg.num_attention_heads
    empty = torch.zeros(bs, cfg.num_key_value_heads, 0, head_dim)
    prefix = PrefixContext([(empty, empty)] * model.config.num_layers, torch.zeros(bs, 0).bool())
    settings = DraftSettings(num_blocks=2, bucket_map=(2, 2, 2, 2), max_nodes=40, max_starts=3)
    cond = torch.randn(bs, D, generator=torch.Generator().manual_seed(1))
    return grow_trees(model, prefix, cond, [5, 9][:bs], torch.tensor([4, 6][:bs]), settings)


def test_node_sources_locate_each_nodes_draft_distribution():
    drafted = _drafted(specblock_drafter(seed=1))
    model = specblock_drafter(seed=1)
    t2d = target_to_draft_map(model.d2t, V)
    checked = 0
    for b, tree in enumerate(drafted.trees):
        sources = drafted.node_source[b]
        assert len(sources) == tree.num_nodes and sources[0] == (-1, -1, -1)
        for node in range(1, tree.num_nodes):
            r, row, slot = sources[node]
            logp = drafted.round_logits[r][b, row, slot].float().log_softmax(-1)
            gained = tree.score[node] - tree.score[tree.parents[node]]
            assert gained == pytest.approx(float(logp[t2d[tree.tokens[node]]]), abs=1e-5)
            checked += 1
    assert checked > 10 and drafted.num_forwards == 2


def test_rejected_prob_reads_the_path_ends_distribution():
    model = specblock_drafter(seed=1)
    drafted = _drafted(model, bs=1)
    tree, sources = drafted.trees[0], drafted.node_source[0]
    t2d = target_to_draft_map(model.d2t, V)
    child = tree.parents.index(0)
    probs = drafted.round_logits[0][0, 0, 0].float().softmax(-1)
    target_id = int(model.d2t[3])
    r = rejected_prob(tree.parents, sources, drafted.round_logits, 0, [0], int(t2d[target_id]))
    assert r == pytest.approx(float(probs[3])) and sources[child] == (0, 0, 0)
    assert rejected_prob(tree.parents, sources, drafted.round_logits, 0, [0], -1) == 0.0
    leaf = max(range(tree.num_nodes), key=lambda i: tree.depth[i])
    assert rejected_prob(tree.parents, sources, drafted.round_logits, 0, [leaf], 3) is None


def test_online_adapter_tracks_queries_windows_and_syncs_an_update():
    model = specblock_drafter(seed=5)
    cfg = _cfg(warmup_queries=1, cold_start_events=8, window=4, lr=1e-2, steps_per_update=1)
    adapter = OnlineAdapter(model, cfg)
    drafted = _drafted(model)
    before = model.lm_head.weight.detach().clone()
    parents = [t.parents for t in drafted.trees]
    gen = torch.Generator().manual_seed(0)

    def step(slots: list[int], lens: list[int], now: float) -> None:
        paths = [[0], [0]][: len(slots)]  # nothing accepted: every step rejects at depth 1
        tokens = torch.randint(0, V, (len(slots), 12), generator=gen)
        feats = torch.randn(len(slots), 12, 3 * D, generator=gen)
        adapter.after_verify(slots, lens, parents, drafted.node_source, drafted.round_logits,
                             paths, tokens, feats, [1, 2][: len(slots)], now=now)  # fmt: skip

    for i in range(10):  # two requests, 10 steps each, one token per step
        step([3, 8], [20 + i, 30 + i], now=float(i))
    assert adapter.bandit.num_queries == 0 and adapter.tokens_total == 20
    query = adapter.queries[3]
    assert query.verifies == 10 and len(query.examples) == 1  # 10 tokens: one 4+3 window
    assert query.signal > 0
    step([8], [40], now=10.0)  # slot 3 left the batch: query finished (warm-up)
    assert adapter.bandit.num_queries == 1
    step([5], [7], now=11.0)  # slot 8 left; its 10 tokens give a window: HEAD trigger
    assert adapter.bandit.num_queries == 2 and adapter.bandit.pending
    action, loss = adapter.trainer.results.get(timeout=120)
    adapter.trainer.results.put((action, loss))
    assert loss is not None
    adapter.before_draft(now=12.0)
    assert adapter.bandit.num_updates == 1 and adapter.bandit.measuring
    assert not torch.equal(model.lm_head.weight, before)
    adapter.close()


# ---- benchmark helpers (no servers) ------------------------------------------------------------


def test_bench_stream_and_windows():

    import bench_specblock_adapt as bench

    stream = bench.build_stream(5, 300, seed=1)
    assert stream == bench.build_stream(5, 300, seed=1) and len(stream) == 5
    assert all(len(p) <= 300 and p.count(" ") > 15 for p in stream)  # prose, not code
    assert not any("def " in p or "import " in p for p in stream)
    base = [([1] * 10, 2.0, 1.0), ([1] * 10, 2.0, 1.0), ([1] * 4, 1.0, 1.0)]
    adapt = [([1] * 10, 3.0, 0.5), ([1] * 10, 3.0, 1.5), ([1] * 4, 1.0, 2.0)]
    rows = bench.window_table([base], [adapt], 2)
    assert [r["queries"] for r in rows] == ["0-1", "2-2"]
    assert rows[0]["tau_adapt"] == 3.0 and rows[0]["tp_ratio"] == pytest.approx(1.0)
    assert rows[1]["tp_ratio"] == pytest.approx(0.5)
    # two runs of each kind pool their queries: tokens over seconds, tau over queries
    slow = [([1] * 10, 1.0, 4.0), ([1] * 10, 1.0, 4.0), ([1] * 4, 1.0, 4.0)]
    rows = bench.window_table([base, slow], [adapt, adapt], 2)
    assert rows[0]["tau_no_adapt"] == pytest.approx(1.5)
    assert rows[0]["tp_no_adapt"] == pytest.approx(40 / 10)
    assert rows[0]["tp_ratio"] == pytest.approx((40 / 4) / (40 / 10))
    assert bench.run_order(1) == [False, True]
    assert bench.run_order(2) == [False, True, True, False]
    assert bench.run_order(3)[4:] == [False, True]
    with pytest.raises(SystemExit):
        bench.parse_args(["--model-path", "m"])  # no drafter
    with pytest.raises(SystemExit):
        bench.parse_args(["--rounds", "0", "--model-path", "m", "--specblock-drafter-path", "d"])


def test_cut_windows_starts_one_every_w_positions_and_returns_the_tail():
    tokens = torch.arange(20)
    feats = torch.arange(20.0).unsqueeze(1).expand(20, 3)
    windows, rest = cut_windows(feats, tokens, window=4, block_size=3)  # span 7
    assert [w.tokens.tolist() for w in windows] == [list(range(s, s + 7)) for s in (0, 4, 8, 12)]
    assert all(
        w.num_starts == 4 and torch.equal(w.features[:, 0], w.tokens.float()) for w in windows
    )
    assert rest == 16  # 16..19: too short for a window; a stream keeps it
    assert cut_windows(feats[:6], tokens[:6], window=4, block_size=3) == ([], 0)


def test_offline_bench_cuts_the_windows_the_serving_adapter_cuts():
    """``specblock_adapt_offline.query_examples`` claims to train on what serving trains on:
    the same windows as ``OnlineAdapter`` cuts from a query committed a few tokens a step."""

    import specblock_adapt_offline as offline

    model = specblock_drafter(seed=2)
    cfg = _cfg(window=4, max_examples_per_query=3)
    adapter = OnlineAdapter(model, cfg)
    gen = torch.Generator().manual_seed(1)
    first, total = 5, 5 + 37
    tokens = torch.randint(0, V, (total,), generator=gen)
    feats = torch.randn(total, 3 * D, generator=gen)
    query = _Query(first)
    pos = first
    for n in (1, 3, 2, 4, 1, 4, 4, 2, 3, 4, 4, 5):  # accepted tokens per verify
        n = min(n, total - pos)
        adapter._extend_history(query, feats[pos : pos + n], tokens[pos : pos + n].tolist())
        pos += n
    assert pos == total
    expected = offline.query_examples(feats, tokens, first, cfg, K)
    assert len(query.examples) == len(expected) == 3
    for got, want in zip(query.examples, expected, strict=True):
        assert torch.equal(got.tokens, want.tokens) and torch.equal(got.features, want.features)
        assert got.num_starts == want.num_starts == cfg.window
    adapter.close()
