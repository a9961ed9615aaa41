"""The scheduler's supervised link to the draft server (``sgl_spec/minedraft/link.py``) with a
fake client: what travels (only new tokens; the whole sequence for new or re-sent requests),
and that every fault -- exit, hang, malformed output, unknown request -- yields no drafts,
restarts the server in the background and re-sends every request afterwards."""

from __future__ import annotations

import time

import numpy as np
import pytest

from sgl_spec.minedraft import link as link_module
from sgl_spec.minedraft.client import DraftServerError
from sgl_spec.minedraft.link import DraftJob, DraftLink
from sgl_spec.minedraft.messages import DraftOutput, DraftResult, ErrorReport


class FakeClient:
    """Drafts ``seq_len + k`` for k = 1..3 for each entry; failure modes are switched on."""

    def __init__(self) -> None:
        self.generation = 0
        self.pid = 100
        self.sent = []
        self.fail_submit = False
        self.hang = False
        self.garbage = False
        self.stranger = False
        self.errors: list[ErrorReport] = []
        self.restart_failures = 0
        self.num_stale = 0
        self.waits: list[float] = []  # collect's timeouts
        self.latency = 0.0  # seconds from a submit to its result (a slow server)
        self._queue: list[tuple[float, object]] = []  # (ready at, request) in submit order

    def start(self) -> None:
        self.generation += 1

    def restart(self) -> None:
        if self.restart_failures:
            self.restart_failures -= 1
            raise DraftServerError("boom")
        self.pid += 1
        self.start()

    def close(self) -> None:
        pass

    def submit(self, request) -> None:
        if self.fail_submit:
            raise DraftServerError("exited with code -9")
        self.sent.append(request)
        self._queue.append((time.monotonic() + self.latency, request))

    def collect(self, timeout_s: float, step_id: int | None = None):
        self.waits.append(timeout_s)
        if self.hang:
            time.sleep(timeout_s)
            return None
        deadline = time.monotonic() + timeout_s
        while self._queue and self._queue[0][0] <= deadline:
            ready_at, request = self._queue.pop(0)
            time.sleep(max(0.0, ready_at - time.monotonic()))
            if request.step_id == step_id:
                return self._result(request)
            self.num_stale += 1  # an answer to a step given up on
        time.sleep(max(0.0, deadline - time.monotonic()))
        return None

    def _result(self, request) -> DraftResult:
        outputs = []
        for entry in request.entries:
            ids = np.arange(entry.seq_len + 1, entry.seq_len + 4, dtype=np.int32)
            if self.garbage:
                ids = np.array([-5, 10**9], dtype=np.int32)
            outputs.append(DraftOutput(entry.rid, ids))
        if self.stranger:
            outputs.append(DraftOutput("nobody", np.array([1], dtype=np.int32)))
        draft_s = max(0.01, self.latency)  # what the server reports
        return DraftResult(request.step_id, request.batch_id, tuple(outputs), draft_s)

    def take_errors(self) -> list[ErrorReport]:
        errors, self.errors = self.errors, []
        return errors


@pytest.fixture(autouse=True)
def fast_backoff(monkeypatch) -> None:
    monkeypatch.setattr(link_module, "RESTART_BACKOFF_S", (0.01,))


def wait_up(link: DraftLink) -> None:
    deadline = time.monotonic() + 5
    while not link.up and time.monotonic() < deadline:
        time.sleep(0.01)
    assert link.up


def test_only_new_tokens_travel_and_drafts_are_keyed_by_length() -> None:
    client = FakeClient()
    link = DraftLink(client, timeout_s=1.0)
    link.start()
    assert link.submit(1, 0, [DraftJob("a", [5, 6, 7], 2)])
    drafts, draft_s = link.collect(1)
    assert drafts["a"][0] == 3 and drafts["a"][1].tolist() == [4, 5, 6] and draft_s == 0.01
    entry = client.sent[-1].entries[0]
    assert entry.is_new and entry.prompt_ids.tolist() == [5, 6, 7]
    assert link.submit(2, 1, [DraftJob("a", [5, 6, 7, 8, 9], 2)])
    entry = client.sent[-1].entries[0]
    assert not entry.is_new and entry.appended_ids.tolist() == [8, 9] and entry.seq_len == 5
    link.collect(2)
    link.removed(["a", "never-sent"])
    assert link.submit(3, 0, [DraftJob("b", [1], 1)])
    assert client.sent[-1].removed_rids == ("a",)


def test_catch_up_sends_new_tokens_unawaited_and_never_piles_up() -> None:
    """Between drafted steps the server is sent what it lags (``lag``), nothing is waited for,
    at most ``MAX_CATCH_UPS`` such jobs are unanswered, and their results are dropped at the
    next awaited collect without counting as silence (no hang suspected)."""
    client = FakeClient()
    client.latency = 0.2  # the server is still busy with the catch-ups below
    link = DraftLink(client, timeout_s=5.0)
    link.start()
    assert link.lag("a", 3) == 3  # never sent: the whole sequence
    assert link.catch_up(1, [DraftJob("a", [5, 6, 7], 2)])
    assert link.lag("a", 5) == 2 and client.waits == [0.0]  # only a non-blocking look
    assert link.catch_up(2, [DraftJob("a", [5, 6, 7, 8, 9], 2)])
    assert client.sent[-1].entries[0].appended_ids.tolist() == [8, 9]
    assert link_module.MAX_CATCH_UPS == 2
    assert not link.catch_up(3, [DraftJob("a", [5, 6, 7, 8, 9, 10], 2)])  # two unanswered
    assert link.lag("a", 6) == 1  # the refused job sent nothing
    time.sleep(0.25)  # both answered: room again
    assert link.catch_up(4, [DraftJob("a", [5, 6, 7, 8, 9, 10], 2)])
    assert link.submit(5, 0, [DraftJob("a", [5, 6, 7, 8, 9, 10, 11], 2)])
    assert not link.catch_up(6, [DraftJob("a", [5, 6, 7, 8, 9, 10, 11, 12], 2)])  # awaited
    drafts, _ = link.collect(5)
    assert drafts["a"][0] == 7
    assert link._num_unanswered == 0 and not link._unanswered
    assert link.num_faults == 0


def test_feature_rows_travel_with_their_tokens() -> None:
    """SpecBlock drafter: a new (or re-sent) request carries the rows of every position but the
    newest, an update those of the positions that gained them since the last one."""
    client = FakeClient()
    link = DraftLink(client, timeout_s=1.0)
    link.start()
    asked = []

    def rows(start: int, end: int) -> np.ndarray:
        asked.append((start, end))
        return np.full((end - start, 2), start, dtype=np.float32)

    link.submit(1, 0, [DraftJob("a", [5, 6, 7], 2, rows)])
    assert client.sent[-1].entries[0].features.shape == (2, 2)
    link.collect(1)
    link.submit(2, 1, [DraftJob("a", [5, 6, 7, 8, 9], 2, rows)])
    entry = client.sent[-1].entries[0]
    assert entry.features.shape == (2, 2) and entry.features[0, 0] == 2
    link.collect(2)
    link.submit(3, 0, [DraftJob("a", [5, 6, 7, 8, 9], 2, rows)])  # nothing new
    assert client.sent[-1].entries[0].features.shape == (0, 2)
    assert asked == [(0, 2), (2, 4), (4, 4)]
    link.submit(4, 1, [DraftJob("b", [1, 2], 1)])
    assert client.sent[-1].entries[0].features is None  # a draft LM: tokens only

    def broken(start: int, end: int) -> np.ndarray:
        raise IndexError("no such row")

    assert link.submit(5, 0, [DraftJob("c", [1, 2, 3], 1, broken)])  # never raises
    assert client.sent[-1].entries[0].features is None  # the server keeps "c" undrafted


@pytest.mark.parametrize("mode", ["fail_submit", "hang", "stranger"])
def test_fault_gives_no_drafts_then_restart_resends_everything(mode: str) -> None:
    client = FakeClient()
    client.restart_failures = 1  # the first restart attempt fails too; the link retries
    link = DraftLink(client, timeout_s=0.01)
    told: list[int] = []
    link.on_restart = told.append  # the metrics counter, told before any later step
    link.start()
    link.submit(1, 0, [DraftJob("a", [1, 2], 1)])
    link.collect(1)
    setattr(client, mode, True)
    ok = link.submit(2, 1, [DraftJob("a", [1, 2, 3], 1)])
    assert link.collect(2) is None
    assert link.num_faults == 1 and (mode == "fail_submit") == (not ok)
    setattr(client, mode, False)
    wait_up(link)
    assert link.num_restarts == 1 and client.generation == 2 and told == [1]
    link.submit(3, 0, [DraftJob("a", [1, 2, 3, 4], 1)])
    entry = client.sent[-1].entries[0]
    assert entry.is_new and entry.prompt_ids.tolist() == [1, 2, 3, 4]  # re-sent whole
    assert link.collect(3) is not None


def test_malformed_drafts_are_a_fault() -> None:
    client = FakeClient()
    link = DraftLink(client, timeout_s=1.0)
    link.start()
    client.garbage = True
    link.submit(1, 0, [DraftJob("a", [1, 2], 1)])
    drafts, _ = link.collect(1)
    assert not link.check_output(drafts, vocab_size=100, max_len=3)
    assert link.num_faults == 1


def test_dropped_request_is_resent_with_its_prompt() -> None:
    client = FakeClient()
    link = DraftLink(client, timeout_s=1.0)
    link.start()
    link.submit(1, 0, [DraftJob("a", [1, 2], 1)])
    client.errors = [ErrorReport("seq_len mismatch", step_id=1, rids=("a",))]
    link.collect(1)
    link.submit(2, 1, [DraftJob("a", [1, 2, 3], 1)])
    assert client.sent[-1].entries[0].is_new and link.num_faults == 0


def test_hung_server_costs_one_short_wait_then_a_restart(monkeypatch) -> None:
    """A hung server: the first sync point waits the short budget, later ones do not wait at
    all (their batches go undrafted), and once the server has been silent for ``timeout_s``
    the link faults and restarts it: no step ever waits ``timeout_s``."""
    monkeypatch.setattr(link_module, "SOFT_WAIT_FLOOR_S", 0.05)
    client = FakeClient()
    link = DraftLink(client, timeout_s=0.5)
    link.start()
    link.submit(1, 0, [DraftJob("a", [1, 2], 1)])
    assert link.collect(1) is not None
    client.hang = True
    client.waits.clear()
    hung_at = time.monotonic()
    step = 2
    while link.num_faults == 0 and step < 500:
        link.submit(step, step % 2, [DraftJob("a", list(range(1, step + 2)), 1)])
        assert link.collect(step) is None
        step += 1
        time.sleep(0.005)
    assert link.num_faults == 1 and "hung" in link.last_fault
    assert time.monotonic() - hung_at >= 0.5
    assert 0 < client.waits[0] < 0.5 and set(client.waits[1:]) == {0.0}
    client.hang = False
    wait_up(link)
    link.submit(step, 0, [DraftJob("a", [1, 2, 3], 1)])
    assert client.sent[-1].entries[0].is_new and link.collect(step) is not None


def test_slow_server_is_waited_for_longer_not_restarted(monkeypatch) -> None:
    """A server slower than the first budget: that sync point goes undrafted and its late
    reply (stale) proves the server alive; the budget grows past the server's latency, so
    later sync points get their drafts, and nothing is restarted."""
    monkeypatch.setattr(link_module, "SOFT_WAIT_FLOOR_S", 0.01)
    client = FakeClient()
    client.latency = 0.05
    link = DraftLink(client, timeout_s=1.0)
    link.start()
    got = []
    for step in range(1, 12):
        link.submit(step, step % 2, [DraftJob("a", list(range(1, step + 2)), 1)])
        time.sleep(0.02)  # the target verifies the other batch meanwhile
        got.append(link.collect(step) is not None)
    assert link.num_faults == 0 and client.num_stale >= 1
    assert not got[0] and all(got[-5:]), got


def test_cpu_draft_server_hides_the_gpus() -> None:
    """SGLang picks CUDA or CPU kernels once per process from what it sees at import: a CPU
    draft server beside a GPU target must not see the GPU (seen on an H200: CUDA's KV-store
    kernel called on CPU tensors)."""
    from sgl_spec.minedraft.client import draft_server_env

    base = {"CUDA_VISIBLE_DEVICES": "0,1", "KEEP": "1"}
    for device in ("cpu", "cpu:2"):
        env = draft_server_env(device, base)
        assert env["CUDA_VISIBLE_DEVICES"] == "" and env["SGLANG_USE_CPU_ENGINE"] == "1"
        assert env["KEEP"] == "1"
    env = draft_server_env("cuda:1", base)
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1" and "SGLANG_USE_CPU_ENGINE" not in env
    assert base == {"CUDA_VISIBLE_DEVICES": "0,1", "KEEP": "1"}


def test_a_late_reply_taken_by_a_catch_up_counts_as_heard(monkeypatch) -> None:
    """Results come in submit order: a late answer to an awaited step that a catch-up's look
    takes is that step's reply (the server lives, waits are normal again), not a catch-up's."""
    monkeypatch.setattr(link_module, "SOFT_WAIT_FLOOR_S", 0.05)
    client = FakeClient()
    client.latency = 0.2
    link = DraftLink(client, timeout_s=5.0)
    link.start()
    assert link.submit(1, 0, [DraftJob("a", [1, 2, 3], 2)])
    assert link.collect(1) is None and link._late  # gave up waiting
    time.sleep(0.25)
    assert link.catch_up(2, [DraftJob("b", [4, 5], 1)])
    assert not link._late and link._num_unanswered == 0 and len(link._unanswered) == 1
    assert link.num_faults == 0


def test_catch_up_tokens_from_the_environment(monkeypatch) -> None:
    from sgl_spec.minedraft import worker

    monkeypatch.delenv(worker.CATCH_UP_ENV, raising=False)
    assert worker.catch_up_tokens() == worker.CATCH_UP_TOKENS
    monkeypatch.setenv(worker.CATCH_UP_ENV, "0")
    assert worker.catch_up_tokens() == 0
    for bad in ("-1", "many", ""):
        monkeypatch.setenv(worker.CATCH_UP_ENV, bad)
        with pytest.raises(ValueError, match=worker.CATCH_UP_ENV):
            worker.catch_up_tokens()
