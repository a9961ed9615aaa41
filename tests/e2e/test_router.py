"""Replicas behind SGLang's own router (``sglang-router``, pinned in pyproject's test extras):
two MINEDRAFT servers (each with its own draft server: the case that needs most of the plugin,
a process of its own per replica; the other algorithms keep all their state in the scheduler, as
the data-parallel tests in ``test_parallel`` show) launched through
sgl-spec's launcher, the router in front with round-robin, mixed traffic through it
(``/generate`` one by one and concurrent, ``/v1/completions``); every greedy response equals
the non-speculative server's, and both replicas served."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from tests.helpers.lossless import PROMPTS
from tests.helpers.server_utils import Server, pick_port, tail

pytestmark = pytest.mark.server

CHAIN = ["--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
         "--speculative-num-draft-tokens", "4"]  # fmt: skip
GREEDY = {"temperature": 0, "max_new_tokens": 48}


class Router:
    """``python -m sglang_router.launch_router`` over ``workers``, ready once it has registered
    every one of them."""

    def __init__(self, workers: list[str], log_path, timeout: float = 120.0) -> None:
        self.url = f"http://127.0.0.1:{pick_port()}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
               "--port", self.url.rsplit(":", 1)[1], "--policy", "round_robin",
               "--worker-urls", *workers,
               # SGLang's /health runs a one-token generate and gives itself 20 s; the router's
               # 5 s default can miss it on a loaded 2-core host, and it then never registers.
               "--health-check-timeout-secs", "30"]  # fmt: skip
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, tail(log_path)
            try:  # the router is up at once and registers its workers in the background
                info = requests.get(self.url + "/get_server_info", timeout=10).json()
                if info.get("workers_count", 0) >= len(workers):
                    return
            except (requests.RequestException, ValueError):
                pass
            time.sleep(1)
        self.stop()
        raise TimeoutError(f"router not ready in {timeout:.0f}s:\n{tail(log_path)}")

    def post(self, path: str, payload: dict) -> dict | list:
        resp = requests.post(self.url + path, json=payload, timeout=600)
        resp.raise_for_status()
        return resp.json()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._log.close()


def _requests_served(server: Server) -> float:
    text = requests.get(server.url + "/metrics", timeout=30).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("sglang:num_requests_total")
    )


def _replica_report(replicas: list[Server], router_log) -> str:
    """Each replica's log tail, then (last, where a truncated CI log still shows it) whether its
    process lives, what its /health answers, and the router's first and last registration
    errors."""
    tails, summary = [], []
    for server in replicas:
        tails.append(server.tail(20))
        start = time.monotonic()
        try:
            status = requests.get(server.url + "/health", timeout=60).status_code
        except requests.RequestException as exc:
            status = repr(exc)[:200]
        summary.append(
            f"{server.url}: exit code {server.proc.poll()} (None: running), /health {status} in"
            f" {time.monotonic() - start:.1f}s"
        )
    text = re.sub(r"\x1b\[[0-9;]*m", "", router_log.read_text(errors="replace"))
    errors = [line.split("error=", 1)[1] for line in text.splitlines() if "error=" in line]
    if errors:
        summary += ["router, first error: " + errors[0][-400:], "last: " + errors[-1][-400:]]
    return "\n".join([*tails, *summary])


def test_two_replicas_behind_the_router_serve_greedy_equal(
    tiny_models, baseline_greedy, tmp_path
) -> None:
    args = ["--model-path", str(tiny_models["target"]), "--speculative-algorithm",
            "MINEDRAFT", "--minedraft-steps", "fixed",
            "--speculative-draft-model-path", str(tiny_models["draft"]),
            *CHAIN, "--enable-metrics"]  # fmt: skip
    with ThreadPoolExecutor(2) as pool:  # started side by side: each waits on imports mostly
        starts = [pool.submit(Server, args, tmp_path / f"replica{i}.log") for i in range(2)]
    replicas = [s.result() for s in starts if s.exception() is None]
    router = None
    try:
        for start in starts:
            if start.exception() is not None:
                raise start.exception()
        assert [s.draft_servers() for s in replicas] == [1, 1]  # one draft server per replica
        router_log = tmp_path / "router.log"
        try:
            router = Router([s.url for s in replicas], router_log)
        except TimeoutError as exc:  # say what each replica's /health answered, and its log
            raise TimeoutError(f"{exc}\n{_replica_report(replicas, router_log)}") from exc
        expected = baseline_greedy["short"]
        singles = [router.post("/generate", {"text": p, "sampling_params": GREEDY})
                   for p in PROMPTS]  # fmt: skip
        assert [o["output_ids"] for o in singles] == expected
        with ThreadPoolExecutor(4) as pool:  # concurrent (the router takes no batched body)
            together = list(pool.map(
                lambda p: router.post("/generate", {"text": p, "sampling_params": GREEDY}),
                PROMPTS,
            ))  # fmt: skip
        assert [o["output_ids"] for o in together] == expected
        completion = router.post(
            "/v1/completions",
            {"model": str(tiny_models["target"]), "prompt": PROMPTS[0], "temperature": 0,
             "max_tokens": 48},
        )  # fmt: skip
        assert completion["choices"][0]["text"] == singles[0]["text"]
        served = [_requests_served(s) for s in replicas]
        assert all(n > 0 for n in served), served
    finally:
        if router is not None:
            router.stop()
        for server in replicas:
            server.stop()
