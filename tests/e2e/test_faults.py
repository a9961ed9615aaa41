"""Faults under load, on the shipped models: the non-speculative server's greedy outputs of 64
code prompts (the session's ``shipped_greedy``) are the reference, and every speculative server
must return exactly those.

(a) MINEDRAFT, the draft server hung (SIGSTOP) while the 64 requests run concurrently: none
    fails, all equal the reference, no request waits the hang timeout between two tokens
    (a sync point waits its short budget once, then the batches go undrafted), the hang is
    detected after ``--minedraft-draft-timeout`` of silence, logged, counted on ``/metrics``
    (``sglang:spec_draft_server_restarts_total``), the server is restarted and parallel steps
    resume. The SIGKILL case is ``test_minedraft_serving.py``'s bench_serving test.
(b) SPECBLOCK with ``--specblock-adapt``, the trainer raising mid-update (after its first
    optimizer step): the failure is logged, outputs still equal the reference, drafts are
    still accepted (the half-trained weights never reached the serving drafter), and a later
    update is applied.
(c) an abort storm on MINEDRAFT, SPECBLOCK, MTP_LORA and STANDALONE_FULL: a third of the 64
    in-flight requests, drawn at random, are aborted after a random number of streamed chunks,
    half by closing the connection and half by ``/abort_request``; the others (streamed or
    not) return the reference, KV usage at idle (radix-cache entries counted free) is back to
    its value before the storm, and MINEDRAFT's two batches stay balanced (``balance=``
    within one, its draft link never faults).
(d) STANDALONE_FULL's speculation controller raising mid-serving: the server goes on with plain
    decode steps, outputs unchanged.

The faults of (b) and (d) are planted by ``tests/helpers/fault_hooks/sitecustomize.py`` (this
module puts it on the server's ``PYTHONPATH``): a scheduler is another process, so pytest's
monkeypatch cannot reach it, and a fault switch in ``sgl_spec`` would be a test-only code path in
the product; the hook patches the trainer and the controller in the server's own processes, from
``tests/`` only.
"""

from __future__ import annotations

import itertools
import os
import random
import re
import signal
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from soak import ABORT_MODES, Outcome, RequestSpec, idle_loads, send

from sgl_spec.models.registry import DEFAULT_TARGET
from tests.helpers.metrics import scrape, total
from tests.helpers.server_utils import Server, ServerPool
from tests.helpers.shipped import NUM_STDLIB_PROMPTS, STDLIB_MAX_NEW_TOKENS, stdlib_prompt_ids

NUM_REQUESTS = NUM_STDLIB_PROMPTS
MAX_NEW_TOKENS = STDLIB_MAX_NEW_TOKENS
DRAFT_TIMEOUT_S = 10.0
FAULT_HOOKS = Path(__file__).resolve().parents[1] / "helpers" / "fault_hooks"
# Tiny adaptation settings: updates after 2 warm-up queries, one routed query per buffer, two
# optimizer steps per update (so the injected fault strikes after the first).
ADAPT_OPTIONS = "warmup_queries=2,measure_queries=2,buffer_queries=1,window=8,steps_per_update=2"
# The pool is capped at --max-total-tokens (COMMON_ARGS); a static fraction above the tests'
# 0.25 keeps start-up from failing when other processes take RAM while SGLang profiles it.
COMMON = [
    "--model-path", DEFAULT_TARGET,
    "--mem-fraction-static", "0.5",
    "--enable-metrics",
    "--log-level", "info",
]  # fmt: skip
SERVERS = {
    "minedraft": [
        *COMMON,
        "--speculative-algorithm", "MINEDRAFT", "--minedraft-steps", "fixed",
        "--speculative-draft-device", "cpu:1",
        "--speculative-num-steps", "3",
        "--minedraft-draft-timeout", str(DRAFT_TIMEOUT_S),
        "--decode-log-interval", "1",
    ],
    "specblock": [
        *COMMON,
        "--speculative-algorithm", "SPECBLOCK", "--specblock-budget", "fixed",
        "--specblock-adapt", "--specblock-adapt-options", ADAPT_OPTIONS,
    ],
    "mtp_lora": [*COMMON, "--speculative-algorithm", "MTP_LORA", "--mtp-k", "2"],
    "standalone": [
        *COMMON,
        "--speculative-algorithm", "STANDALONE_FULL",
        "--speculative-num-steps", "3",
        "--speculative-eagle-topk", "1",
        "--speculative-num-draft-tokens", "4",
    ],
}  # fmt: skip


@pytest.fixture(scope="module")
def controller_fault(tmp_path_factory) -> Path:
    """The file whose creation makes the STANDALONE_FULL server's controller raise (once)."""
    return tmp_path_factory.mktemp("faults") / "controller"


@pytest.fixture(scope="module")
def servers(tmp_path_factory, controller_fault):
    pool = ServerPool(SERVERS, tmp_path_factory.mktemp("fault_logs"))
    fault_env = {
        "specblock": {"SGLSPEC_FAULT_ADAPT_FAILURES": "1"},
        "standalone": {"SGLSPEC_FAULT_CONTROLLER_FILE": str(controller_fault)},
    }

    def serve(name: str) -> Server:
        with pytest.MonkeyPatch.context() as env:  # what the server's processes inherit
            if name in fault_env:
                env.setenv("PYTHONPATH", str(FAULT_HOOKS), prepend=os.pathsep)
            for key, value in fault_env.get(name, {}).items():
                env.setenv(key, value)
            return pool(name)

    yield serve
    pool.close()


@pytest.fixture(scope="module")
def prompt_ids() -> list[list[int]]:
    """64 code excerpts of the standard library, as the shipped target's token ids."""
    return stdlib_prompt_ids()


@pytest.fixture(scope="module")
def reference(shipped_greedy) -> list[list[int]]:
    """The non-speculative server's greedy ids, all 64 prompts in one batched request."""
    return shipped_greedy["stdlib"]


def _spec(name: str, i: int, ids: list[int], stream: bool, **abort) -> RequestSpec:
    """A greedy request. Its rid is new (SGLang aborts a streamed request's rid again two
    seconds after its stream ends, which would hit a new request reusing it) and bracketed:
    SGLang aborts every request whose rid begins with the aborted one."""
    return RequestSpec(f"<{name}-{i}>", tuple(ids), MAX_NEW_TOKENS, 0.0, stream, **abort)


def _run_all(server: Server, specs: list[RequestSpec], during=None) -> list[Outcome]:
    """Send every spec at once; ``during()`` runs while they are in flight."""
    with ThreadPoolExecutor(len(specs)) as pool:
        futures = [pool.submit(send, server.url, spec) for spec in specs]
        if during is not None:
            during()
        return [f.result() for f in futures]


def _assert_reference(outcomes: list[Outcome], reference: list[list[int]], rows) -> None:
    for i in rows:
        assert outcomes[i].ok, (outcomes[i].rid, outcomes[i].error)
        assert outcomes[i].output_ids == reference[i], outcomes[i].rid


def _minedraft_lines(server: Server) -> list[dict[str, float]]:
    lines = [x for x in server.tail(40000).splitlines() if "MINEDRAFT: steps=" in x]
    return [{k: float(v) for k, v in re.findall(r"(\w+)=([-\d.]+)", x)} for x in lines]


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _draft_pid(server: Server) -> int:
    found = re.findall(r"draft server (?:restarted \()?pid (\d+)", server.tail(40000))
    assert found, server.tail()
    return int(found[-1])


def test_minedraft_hung_draft_server_under_load(servers, prompt_ids, reference) -> None:
    server = servers("minedraft")
    specs = [_spec("hang", i, ids, stream=i % 2 == 0) for i, ids in enumerate(prompt_ids)]
    warm = [_spec("warm", i, ids, stream=False) for i, ids in enumerate(prompt_ids)]
    _assert_reference(_run_all(server, warm), reference, range(NUM_REQUESTS))  # and warm-up
    restarts = total(scrape(server), "sglang:spec_draft_server_restarts_total")
    pid, steps = _draft_pid(server), len(_minedraft_lines(server))

    def hang_a_few_steps_in() -> None:
        _wait_for(lambda: len(_minedraft_lines(server)) >= steps + 4, 300, "decode steps")
        os.kill(pid, signal.SIGSTOP)

    try:
        outcomes = _run_all(server, specs, hang_a_few_steps_in)
        _assert_reference(outcomes, reference, range(NUM_REQUESTS))
        gaps = [o.max_gap_s for o in outcomes if o.max_gap_s]
        assert gaps and max(gaps) < DRAFT_TIMEOUT_S, max(gaps)  # no step waited the timeout
        assert "verifying without them until the draft server replies" in server.tail(40000)
        # The hang is detected on the first sync point DRAFT_TIMEOUT_S after the last reply:
        # keep traffic coming until the restarted server answers.
        deadline = time.monotonic() + 600
        for wave in itertools.count():
            if "parallel mode resumes" in server.tail(40000):
                break
            assert time.monotonic() < deadline, server.tail()
            again = [_spec(f"resume-{wave}", i, prompt_ids[i], stream=False) for i in range(8)]
            _assert_reference(_run_all(server, again), reference, range(8))
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    log = server.tail(40000)
    assert f"no reply within {DRAFT_TIMEOUT_S:.1f}s (hung)" in log
    assert _draft_pid(server) != pid
    assert total(scrape(server), "sglang:spec_draft_server_restarts_total") >= restarts + 1
    resumed_from = _minedraft_lines(server)[-1]
    after = [_spec("resumed", i, prompt_ids[i], stream=False) for i in range(16)]
    _assert_reference(_run_all(server, after), reference, range(16))
    last = _minedraft_lines(server)[-1]
    assert last["restarts"] >= 1 and last["parallel_steps"] > resumed_from["parallel_steps"]


def _abort_storm(server: Server, name: str, prompt_ids, reference) -> list[Outcome]:
    """A third of the requests aborted at random (module docstring); returns the outcomes."""
    rng = random.Random(zlib.crc32(name.encode()))
    aborted = sorted(rng.sample(range(NUM_REQUESTS), NUM_REQUESTS // 3))
    specs = []
    for i, ids in enumerate(prompt_ids):
        if i in aborted:
            mode = ABORT_MODES[aborted.index(i) % 2]
            abort = {"abort": mode, "abort_after": rng.randint(1, 6)}
            specs.append(_spec(f"storm-{name}", i, ids, True, **abort))
        else:
            specs.append(_spec(f"storm-{name}", i, ids, rng.random() < 0.5))
    idle_before = idle_loads(server.url)["num_used_tokens"]
    outcomes = _run_all(server, specs)
    _assert_reference(outcomes, reference, [i for i in range(NUM_REQUESTS) if i not in aborted])
    for i in aborted:  # whatever an aborted request got is the start of the reference
        out = outcomes[i]
        assert out.ok, (out.rid, out.error)
        finished = out.finish in ("length", "stop")
        assert out.output_ids == (reference[i] if finished else reference[i][: len(out.output_ids)])
    assert sum(outcomes[i].aborted for i in aborted) >= len(aborted) // 2  # in flight
    assert idle_loads(server.url)["num_used_tokens"] == idle_before  # no KV slot leaked
    after = _run_all(server, [_spec(f"after-{name}", 0, prompt_ids[0], stream=False)])
    _assert_reference(after, reference, [0])
    return outcomes


def test_abort_storm_minedraft(servers, prompt_ids, reference) -> None:
    server = servers("minedraft")
    before = _minedraft_lines(server)
    _abort_storm(server, "minedraft", prompt_ids, reference)
    during = _minedraft_lines(server)[len(before) :]
    assert during and all(abs(m["balance"]) <= 1 for m in during), during
    assert during[-1]["faults"] == (before[-1]["faults"] if before else 0)  # link never faulted


def test_specblock_adapt_trainer_fails_mid_update(servers, prompt_ids, reference) -> None:
    server = servers("specblock")
    updates, accepts = 0.0, []
    for wave in range(24):  # queries end in waves of 8, so the bandit sees each finish
        rows = [(wave * 8 + k) % NUM_REQUESTS for k in range(8)]
        failed = "injected fault" in server.tail(40000)  # before this wave began
        specs = [_spec(f"adapt-{wave}", i, prompt_ids[i], stream=i % 2 == 1) for i in rows]
        outcomes = _run_all(server, specs)
        _assert_reference(outcomes, [reference[i] for i in rows], range(8))
        if failed:
            accepts += [o.accept_length for o in outcomes if o.accept_length]
            updates = total(
                scrape(server), "sglang:spec_adapt_updates_total", algorithm="SPECBLOCK"
            )
            if updates >= 1:
                break
    log = server.tail(40000)
    assert "update failed; its steps discarded" in log and "injected fault" in log, log
    assert updates >= 1, "no update applied after the failed one"
    assert "adaptation off" not in log
    assert accepts and sum(accepts) / len(accepts) > 1.5, accepts  # drafts still accepted


def test_abort_storm_specblock(servers, prompt_ids, reference) -> None:
    _abort_storm(servers("specblock"), "specblock", prompt_ids, reference)


def test_abort_storm_mtp_lora(servers, prompt_ids, reference) -> None:
    _abort_storm(servers("mtp_lora"), "mtp_lora", prompt_ids, reference)


def test_abort_storm_standalone(servers, prompt_ids, reference) -> None:
    _abort_storm(servers("standalone"), "standalone", prompt_ids, reference)


def test_controller_fails_mid_serving_standalone(servers, prompt_ids, reference, controller_fault):
    """(d) STANDALONE_FULL at its default (``auto``), its controller's ``decide`` raising while
    16 requests are in flight: logged, those and the next 16 return the reference, and every
    step after it runs without drafts (``control/guard.py``)."""
    server = servers("standalone")
    labels = {"algorithm": "STANDALONE_FULL"}
    controller_fault.touch()
    rows = range(16)
    specs = [_spec("ctl-fault", i, prompt_ids[i], stream=i % 2 == 0) for i in rows]
    _assert_reference(_run_all(server, specs), reference, rows)
    log = server.tail(40000)
    assert "injected fault: the controller's decide raises" in log, log
    assert "speculation controller failed" in log, log
    samples = scrape(server)
    drafted = total(samples, "sglang:spec_chosen_k_sum", **labels)
    plain = total(samples, "sglang:spec_plain_steps_total", **labels)
    specs = [_spec("ctl-after", i, prompt_ids[i], stream=i % 2 == 1) for i in rows]
    _assert_reference(_run_all(server, specs), reference, rows)
    samples = scrape(server)
    assert total(samples, "sglang:spec_chosen_k_sum", **labels) == drafted  # no drafts since
    assert total(samples, "sglang:spec_plain_steps_total", **labels) > plain
    assert total(samples, "sglang:spec_controller_failures_total", **labels) == 1
