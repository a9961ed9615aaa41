"""Our speculative metrics, next to SGLang's own ``sglang:spec_*`` gauges.

SGLang's scheduler fills ``sglang:spec_accept_length`` / ``spec_accept_rate`` from every
worker's ``GenerationBatchResult``; this module adds what those do not say, in the same naming
style, for MTP_LORA, SPECBLOCK and MINEDRAFT (docs/metrics.md lists every name):

- per draft position: drafts offered and accepted (counters) and their ratio (gauge);
- draft and verify time per decode step (histograms; MTP_LORA drafts inside its verify
  forward, so its draft time is 0);
- MTP_LORA and SPECBLOCK under their controller: the drafts per request chosen (histogram),
  the steps run without drafts (counter), the tokens per request the controller expected and
  those committed (gauges);
- SPECBLOCK: verified tree size (histogram), adaptation updates and rollbacks (counters);
- MINEDRAFT: the overlap ratio, the two batches' sizes, draft-server restarts.

Prometheus series exist only with ``--enable-metrics`` (SGLang then serves every process's
series on ``/metrics``). The same figures, for the interval since the last report, are appended
to SGLang's periodic ``Decode batch`` log line whether or not metrics are enabled.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

# SGLang's decode log line comes from this logger (scheduler_components/metrics_reporter.py).
DECODE_LOG_LOGGER = "sglang.srt.managers.scheduler_components.metrics_reporter"
_TIME_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_METRICS: dict[str, Any] = {}  # one Prometheus object per name and process


def _metric(kind: str, name: str, doc: str, labels: Sequence[str], **kwargs: Any) -> Any:
    if name not in _METRICS:
        import prometheus_client  # after SGLang set PROMETHEUS_MULTIPROC_DIR

        cls = getattr(prometheus_client, kind)
        if kind == "Gauge":
            kwargs.setdefault("multiprocess_mode", "mostrecent")
        _METRICS[name] = cls(name=name, documentation=doc, labelnames=list(labels), **kwargs)
    return _METRICS[name]


def _reports() -> bool:
    """SGLang exports a tensor-parallel group's series from its first rank only: every rank
    runs the same steps, so the others would count each step again."""
    from sglang.srt.distributed.parallel_state import get_parallel

    try:
        return get_parallel().attn_tp_rank == 0
    except RuntimeError:  # no rank written: a process outside SGLang's schedulers
        return True


@dataclass
class IntervalStats:
    """What happened since the last decode log line."""

    steps: int = 0
    offered: list[int] = field(default_factory=list)  # [position] drafts offered
    accepted: list[int] = field(default_factory=list)  # [position] drafts accepted
    draft_s: float = 0.0
    verify_s: float = 0.0
    k_counts: dict[int, int] = field(default_factory=dict)
    tree_nodes: int = 0
    trees: int = 0
    predictions: int = 0  # steps the controller chose
    predicted: float = 0.0  # Σ its expected tokens per request
    realised: float = 0.0  # Σ the tokens per request those steps committed

    def add_positions(self, num_accepted: Sequence[int], num_offered: Sequence[int]) -> None:
        longest = max(num_offered, default=0)
        if longest > len(self.offered):
            grow = longest - len(self.offered)
            self.offered += [0] * grow
            self.accepted += [0] * grow
        for accepted, offered in zip(num_accepted, num_offered, strict=True):
            for pos in range(offered):
                self.offered[pos] += 1
                self.accepted[pos] += int(accepted > pos)


class SpecMetrics:
    """One per speculative worker; the worker calls ``observe_*`` once per decode step."""

    def __init__(self, algorithm: str, server_args: Any) -> None:
        self.algorithm = algorithm
        self.enabled = bool(getattr(server_args, "enable_metrics", False)) and _reports()
        model = getattr(server_args, "served_model_name", None) or getattr(
            server_args, "model_path", ""
        )
        self.labels = {"model_name": str(model), "algorithm": algorithm}
        self.interval = IntervalStats()
        self.totals = IntervalStats()  # since start (position counts only)
        self.extra_log: dict[str, str] = {}  # algorithm-specific figures for the log line
        self._restarts = self._updates = self._rollbacks = self._plain = self._failures = 0
        _DecodeLogSuffix.install(self)

    def _series(self, kind: str, name: str, doc: str, extra: Sequence[str] = (), **kw: Any):
        return _metric(kind, name, doc, [*self.labels, *extra], **kw)

    def _labels(self, metric: Any, **extra: str) -> Any:
        return metric.labels(**self.labels, **extra)

    def observe_step(
        self,
        num_accepted: Sequence[int],  # per request: accepted drafts (bonus token excluded)
        num_offered: Sequence[int],  # per request: drafts verified along its accepted path
        draft_s: float,
        verify_s: float,
    ) -> None:
        """A decode step: position p of a request counts as offered when it had a draft at
        depth p on the path verification followed, and as accepted when that draft was."""
        stats = self.interval
        stats.steps += 1
        stats.draft_s += draft_s
        stats.verify_s += verify_s
        stats.add_positions(num_accepted, num_offered)
        if not self.enabled:
            return
        offered = self._series(
            "Counter", "sglang:spec_position_drafts", "Drafts verified per draft position.",
            ["position"],
        )  # fmt: skip
        accepted = self._series(
            "Counter", "sglang:spec_position_accepted", "Drafts accepted per draft position.",
            ["position"],
        )  # fmt: skip
        rate = self._series(
            "Gauge", "sglang:spec_position_accept_rate",
            "Accepted / verified drafts per draft position, since start.", ["position"],
        )  # fmt: skip
        totals = self.totals
        totals.add_positions(num_accepted, num_offered)
        pairs = list(zip(num_accepted, num_offered, strict=True))
        for pos in range(max(num_offered, default=0)):
            label = str(pos + 1)
            self._labels(offered, position=label).inc(sum(o > pos for _, o in pairs))
            self._labels(accepted, position=label).inc(sum(o > pos and a > pos for a, o in pairs))
            self._labels(rate, position=label).set(totals.accepted[pos] / totals.offered[pos])
        for name, seconds, doc in (
            ("sglang:spec_draft_seconds", draft_s, "Drafting time per decode step."),
            ("sglang:spec_verify_seconds", verify_s, "Verify time per decode step."),
        ):
            hist = self._series("Histogram", name, doc, buckets=_TIME_BUCKETS)
            self._labels(hist).observe(seconds)

    def observe_k(self, k: int) -> None:
        """The drafts per request chosen for a step: MTP_LORA's mask tokens, SPECBLOCK's node
        budget - 1, STANDALONE_FULL's chain length, MINEDRAFT's drafts verified."""
        self.interval.k_counts[k] = self.interval.k_counts.get(k, 0) + 1
        if self.enabled:
            hist = self._series(
                "Histogram", "sglang:spec_chosen_k", "Drafts per request chosen for a step.",
                buckets=tuple(range(0, 17)),
            )  # fmt: skip
            self._labels(hist).observe(k)
        if k == 0:
            self._plain = self._count("sglang:spec_plain_steps_total", self._plain, self._plain + 1)

    def observe_prediction(self, predicted: float, realised: float) -> None:
        """A step the speculation controller chose: the tokens per request it expected (its
        λ) and the mean the step committed (accepted drafts + 1)."""
        stats = self.interval
        stats.predictions += 1
        stats.predicted += predicted
        stats.realised += realised
        if self.enabled:
            for name, value, what in (
                ("sglang:spec_predicted_accept_length", predicted, "expected by the controller"),
                ("sglang:spec_realised_accept_length", realised, "committed"),
            ):
                doc = f"Tokens per request of the last controlled step, {what}."
                self._labels(self._series("Gauge", name, doc)).set(value)

    def observe_trees(self, num_nodes: Sequence[int]) -> None:
        """SPECBLOCK: nodes verified per request (root included)."""
        self.interval.tree_nodes += sum(num_nodes)
        self.interval.trees += len(num_nodes)
        if self.enabled:
            hist = self._series(
                "Histogram", "sglang:spec_tree_size", "Draft tree nodes verified per request.",
                buckets=_SIZE_BUCKETS,
            )  # fmt: skip
            for n in num_nodes:
                self._labels(hist).observe(n)

    def set_adaptation(self, num_updates: int, num_rollbacks: int) -> None:
        """SPECBLOCK online adaptation: running totals of drafter updates and rollbacks."""
        self.extra_log["adapt_updates"] = str(num_updates)
        self.extra_log["adapt_rollbacks"] = str(num_rollbacks)
        self._updates = self._count("sglang:spec_adapt_updates", self._updates, num_updates)
        self._rollbacks = self._count("sglang:spec_adapt_rollbacks", self._rollbacks, num_rollbacks)

    def set_restarts(self, num_restarts: int) -> None:
        """MINEDRAFT: running total of draft server restarts, counted when one finishes (from
        the restart thread), not at the next phase: a restart during an idle spell shows."""
        self.extra_log["restarts"] = str(num_restarts)
        self._restarts = self._count(
            "sglang:spec_draft_server_restarts", self._restarts, num_restarts
        )

    def controller_failed(self, reason: str) -> None:
        """The speculation controller raised (``control/guard.py``): every later step runs
        without drafts. Counted, and said on every decode log line from then on."""
        del reason  # logged with its traceback where it happened
        self.extra_log["controller"] = "failed"
        self._failures = self._count("sglang:spec_controller_failures", self._failures, 1)

    def observe_phase(self, overlap_ratio: float, num_verified: int, num_drafted: int) -> None:
        """MINEDRAFT: one phase (verify one batch while the draft server drafts the other)."""
        self.extra_log["overlap"] = f"{overlap_ratio:.2f}"
        if not self.enabled:
            return
        gauge = self._series(
            "Gauge", "sglang:spec_overlap_ratio",
            "MINEDRAFT (T_draft + T_verify) / max(T_draft, T_verify) over parallel phases.",
        )  # fmt: skip
        self._labels(gauge).set(overlap_ratio)
        hist = self._series(
            "Histogram", "sglang:spec_batch_size", "Requests per MINEDRAFT batch and phase.",
            ["role"], buckets=_SIZE_BUCKETS,
        )  # fmt: skip
        self._labels(hist, role="verify").observe(num_verified)
        self._labels(hist, role="draft").observe(num_drafted)

    def _count(self, name: str, seen: int, total: int) -> int:
        """Advance a counter to a running ``total`` kept elsewhere; returns the new total."""
        if self.enabled and total > seen:
            doc = name.removeprefix("sglang:spec_").replace("_", " ") + " (count)."
            self._labels(self._series("Counter", name, doc)).inc(total - seen)
        return max(total, seen)

    def take_log_suffix(self) -> str:
        """The interval's figures for SGLang's decode log line; starts a new interval."""
        stats, self.interval = self.interval, IntervalStats()
        if stats.steps == 0:
            return ""
        rates = ",".join(
            f"{a / o:.2f}" for a, o in zip(stats.accepted, stats.offered, strict=True) if o
        )
        parts = [
            f"{self.algorithm}: pos accept [{rates}]",
            f"draft ms/step {1e3 * stats.draft_s / stats.steps:.2f}",
            f"verify ms/step {1e3 * stats.verify_s / stats.steps:.2f}",
        ]
        if stats.k_counts:
            parts.append(f"k {dict(sorted(stats.k_counts.items()))}")
        if stats.trees:
            parts.append(f"tree nodes {stats.tree_nodes / stats.trees:.1f}")
        if stats.predictions:
            n = stats.predictions
            parts.append(f"pred/real tokens {stats.predicted / n:.2f}/{stats.realised / n:.2f}")
        parts += [f"{key.replace('_', ' ')} {value}" for key, value in self.extra_log.items()]
        return ", ".join(parts)


def count_controller_failures(controller: Any, metrics: SpecMetrics | None) -> None:
    """Have ``metrics`` count a failure of ``controller`` where it is guarded
    (``control/guard.py``) and metrics exist."""
    when_failed = getattr(controller, "when_failed", None)
    if when_failed is not None and metrics is not None:
        when_failed(metrics.controller_failed)


class _DecodeLogSuffix(logging.Filter):
    """Appends the worker's figures to SGLang's ``Decode batch`` log line (one per process)."""

    _installed: _DecodeLogSuffix | None = None

    def __init__(self, metrics: SpecMetrics) -> None:
        super().__init__()
        self.metrics = metrics

    @classmethod
    def install(cls, metrics: SpecMetrics) -> None:
        if cls._installed is not None:
            cls._installed.metrics = metrics
            return
        cls._installed = cls(metrics)
        logging.getLogger(DECODE_LOG_LOGGER).addFilter(cls._installed)

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and record.msg.startswith("Decode batch"):
            suffix = self.metrics.take_log_suffix()
            if suffix:
                record.msg = f"{record.msg}, {suffix}"
        return True
