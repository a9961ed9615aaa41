"""Our speculative metrics (sgl_spec/common/metrics.py): position counts, Prometheus series,
and the suffix on SGLang's decode log line."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from prometheus_client import REGISTRY

from sgl_spec.common.metrics import DECODE_LOG_LOGGER, IntervalStats, SpecMetrics


def _args(enabled: bool) -> SimpleNamespace:
    return SimpleNamespace(enable_metrics=enabled, served_model_name="m", model_path="m")


def _value(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, {"model_name": "m", **labels})


def test_positions_count_offered_and_accepted_drafts() -> None:
    stats = IntervalStats()
    # request 1: 3 drafts on its path, 2 accepted; request 2: 1 draft, rejected; 3: none
    stats.add_positions([2, 0, 0], [3, 1, 0])
    assert stats.offered == [2, 1, 1]
    assert stats.accepted == [1, 1, 0]


def test_prometheus_series_follow_the_steps() -> None:
    metrics = SpecMetrics("TESTALGO", _args(True))
    metrics.observe_step([2, 0], [3, 1], draft_s=0.01, verify_s=0.02)
    metrics.observe_step([1], [2], draft_s=0.01, verify_s=0.03)
    labels = {"algorithm": "TESTALGO"}
    assert _value("sglang:spec_position_drafts_total", position="1", **labels) == 3
    assert _value("sglang:spec_position_accepted_total", position="1", **labels) == 2
    assert _value("sglang:spec_position_drafts_total", position="3", **labels) == 1
    assert _value("sglang:spec_position_accepted_total", position="3", **labels) == 0
    rate = _value("sglang:spec_position_accept_rate", position="2", **labels)
    assert rate == pytest.approx(1 / 2)
    assert _value("sglang:spec_verify_seconds_count", **labels) == 2
    assert _value("sglang:spec_verify_seconds_sum", **labels) == pytest.approx(0.05)
    metrics.observe_k(3)
    metrics.observe_trees([8, 5])
    assert _value("sglang:spec_chosen_k_sum", **labels) == 3
    assert _value("sglang:spec_tree_size_count", **labels) == 2
    metrics.set_adaptation(num_updates=2, num_rollbacks=0)
    metrics.set_adaptation(num_updates=3, num_rollbacks=1)
    assert _value("sglang:spec_adapt_updates_total", **labels) == 3
    assert _value("sglang:spec_adapt_rollbacks_total", **labels) == 1
    metrics.observe_phase(1.6, num_verified=4, num_drafted=3)
    metrics.set_restarts(1)
    assert _value("sglang:spec_overlap_ratio", **labels) == pytest.approx(1.6)
    assert _value("sglang:spec_draft_server_restarts_total", **labels) == 1
    assert _value("sglang:spec_batch_size_sum", role="draft", **labels) == 3
    metrics.controller_failed("ZeroDivisionError: planted")
    metrics.controller_failed("ZeroDivisionError: planted")  # told again: still one failure
    assert _value("sglang:spec_controller_failures_total", **labels) == 1
    metrics.observe_step([0], [0], draft_s=0.0, verify_s=0.01)
    assert metrics.take_log_suffix().endswith("controller failed")


def test_decode_log_line_gets_the_interval_figures() -> None:
    metrics = SpecMetrics("LOGALGO", _args(False))
    assert metrics.take_log_suffix() == ""  # no step in the interval: nothing appended
    metrics.observe_step([1, 0], [2, 2], draft_s=0.004, verify_s=0.010)
    metrics.observe_k(2)
    record = logging.LogRecord(DECODE_LOG_LOGGER, logging.INFO, "", 0, "Decode batch, x", (), None)
    logging.getLogger(DECODE_LOG_LOGGER).filter(record)
    assert record.msg.startswith("Decode batch, x, LOGALGO: pos accept [0.50,0.00]")
    assert "draft ms/step 4.00" in record.msg and "verify ms/step 10.00" in record.msg
    assert "k {2: 1}" in record.msg
    other = logging.LogRecord(DECODE_LOG_LOGGER, logging.INFO, "", 0, "Prefill batch", (), None)
    logging.getLogger(DECODE_LOG_LOGGER).filter(other)
    assert other.msg == "Prefill batch"
    assert metrics.take_log_suffix() == ""  # the interval restarted at the log line
