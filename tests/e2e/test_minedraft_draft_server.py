"""MineDraft draft server (paper §5.2's Drafter in its own process) driven through its client.

One draft server serves the whole module (its start-up is the cost); drafts are checked against
the draft model's own continuation computed here with transformers in fp32. The server runs with
SGLSPEC_MINEDRAFT_CHECK_KV=1, so after every request it checks that the only KV it holds is that
of verified tokens (draft KV rolled back, freed requests given back) and fails loudly otherwise.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from sgl_spec.minedraft.client import DraftServerClient, DraftServerError
from sgl_spec.minedraft.draft_server import (
    CHECK_KV_ENV,
    EXIT_PARENT_DIED,
    DeviceSpec,
    cpu_core_set,
    parse_device,
)
from sgl_spec.minedraft.messages import DraftEntry, DraftRequest, DraftResult, Hello
from sgl_spec.models.registry import resolve_model_path

DRAFT = "sgl-spec/tiny-code-draft"
NUM_STEPS = 4
START_TIMEOUT_S = 600.0  # start-up imports SGLang: ~30 s on an idle 2-core host
STEP_TIMEOUT_S = 60.0


def make_hello(**overrides: object) -> Hello:
    fields = dict(
        draft_model_path=DRAFT,
        device="cpu:1",
        num_steps=NUM_STEPS,
        num_draft_tokens=NUM_STEPS + 1,
        topk=1,
        max_batch_size=4,
        seed=0,
    )
    return Hello(**{**fields, **overrides})


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(DRAFT), dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def ipc_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("md"))  # short: unix socket paths are <= 107 bytes


@pytest.fixture(scope="module")
def client(ipc_dir: str):
    os.environ[CHECK_KV_ENV] = "1"  # inherited by the server process
    c = DraftServerClient(
        make_hello(), f"test{os.getpid()}", ipc_dir=ipc_dir, handshake_timeout_s=START_TIMEOUT_S
    )
    try:
        c.start()
        yield c
    finally:
        c.close()
        os.environ.pop(CHECK_KV_ENV, None)


@torch.no_grad()
def next_logits(model, tokens: list[int]) -> torch.Tensor:
    return model(torch.tensor([tokens])).logits[0, -1].float()  # [vocab]


def greedy(model, tokens: list[int], n: int = NUM_STEPS) -> list[int]:
    out = list(tokens)
    for _ in range(n):
        out.append(int(next_logits(model, out).argmax()))
    return out[len(tokens) :]


def step(client: DraftServerClient, request: DraftRequest) -> DraftResult:
    client.submit(request)
    result = client.collect(STEP_TIMEOUT_S)
    assert result is not None, "no DraftResult in time"
    assert (result.step_id, result.batch_id) == (request.step_id, request.batch_id)
    return result


# -- device parsing (pure) --------------------------------------------------------------------


def test_parse_device() -> None:
    assert parse_device("cpu") == DeviceSpec("cpu", None)
    assert parse_device("cpu:3") == DeviceSpec("cpu", 3)
    assert parse_device("cuda:1") == DeviceSpec("cuda", 1)
    assert parse_device("cuda:1").torch_device == "cuda:1"
    for bad in ("gpu:0", "cpu:0", "cuda:x", "cpu:-1", ""):
        with pytest.raises(ValueError, match="draft device"):
            parse_device(bad)


def test_cpu_core_set_takes_the_last_cores() -> None:
    assert cpu_core_set(2, {0, 1, 2, 3}) == [2, 3]
    assert cpu_core_set(1, [5, 0, 7]) == [7]
    with pytest.raises(ValueError, match="more cores"):
        cpu_core_set(3, [0, 1])


def test_parent_death_ends_the_server(ipc_dir: str) -> None:
    # --parent-pid names a process that is not our parent (one that has exited): the
    # watchdog sees a different parent and exits at once, before any message arrives.
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    cmd = [sys.executable, "-m", "sgl_spec.minedraft.draft_server", "--instance-id", "orphan"]
    cmd += ["--ipc-dir", ipc_dir, "--parent-pid", str(gone.pid)]
    proc = subprocess.run(cmd, capture_output=True, timeout=120)
    assert proc.returncode == EXIT_PARENT_DIED, proc.stderr.decode()[-2000:]


# -- one served draft server ------------------------------------------------------------------


def test_ready_reports_the_core_set(client: DraftServerClient) -> None:
    assert client.alive() and client.ready is not None
    assert client.ready.pid == client.pid
    assert client.ready.device.startswith("cpu:1 (cores ")


def socket_files(client: DraftServerClient) -> list[str]:
    return [p for p in client.addresses.socket_paths() if os.path.exists(p)]


def test_socket_files_are_removed_once_connected(client: DraftServerClient) -> None:
    """Connected, the pair needs no path: none is left behind when the server is killed (the
    steps of this test and the ones after run over the connections alone)."""
    assert socket_files(client) == []
    step(client, DraftRequest(0, 0, (DraftEntry("s", [], 3, prompt_ids=[5, 6, 7]),)))
    step(client, DraftRequest(1, 0, removed_rids=("s",)))


def test_greedy_drafts_follow_verified_tokens(client: DraftServerClient, hf_model) -> None:
    """Several requests of different lengths over several steps; the verified tokens sometimes
    take all drafts, sometimes diverge after k of them, once append nothing. The drafts must be
    the draft model's greedy continuation of exactly the verified tokens (no draft KV kept)."""
    rng = np.random.default_rng(0)
    vocab = hf_model.config.vocab_size
    seqs = {f"g{i}": rng.integers(1, vocab, size=n).tolist() for i, n in enumerate((3, 9, 17, 30))}
    entries = [DraftEntry(rid, [], len(p), prompt_ids=p) for rid, p in seqs.items()]
    drafts: dict[str, list[int]] = {}
    for step_id in range(5):
        result = step(client, DraftRequest(step_id, step_id % 2, tuple(entries)))
        assert client.take_errors() == []
        assert [o.rid for o in result.outputs] == list(seqs)
        for out in result.outputs:
            assert out.draft_probs is None
            assert out.draft_ids.tolist() == greedy(hf_model, seqs[out.rid]), (step_id, out.rid)
            drafts[out.rid] = out.draft_ids.tolist()
        entries = []
        for i, rid in enumerate(seqs):
            if step_id == 2 and i == 0:
                appended = []
            else:
                k = int(rng.integers(0, NUM_STEPS + 1))  # drafts accepted
                bonus = int(rng.integers(1, vocab))
                if k < NUM_STEPS and bonus == drafts[rid][k]:
                    bonus = bonus % (vocab - 1) + 1  # a rejected draft: diverge
                appended = drafts[rid][:k] + [bonus]
            seqs[rid] = seqs[rid] + appended
            entries.append(DraftEntry(rid, appended, len(seqs[rid])))
    step(client, DraftRequest(99, 0, removed_rids=tuple(seqs)))


def test_seq_len_mismatch_drops_only_that_request(client: DraftServerClient, hf_model) -> None:
    a, b = [11, 12, 13, 14], [21, 22, 23]
    step(client, DraftRequest(0, 0, (DraftEntry("ma", [], 4, a), DraftEntry("mb", [], 3, b))))
    a, b = a + [7], b + [8]
    entries = (DraftEntry("ma", [7], len(a)), DraftEntry("mb", [8], len(b) + 1))  # mb: lost update
    result = step(client, DraftRequest(1, 1, entries))
    errors = client.take_errors()
    assert len(errors) == 1 and errors[0].rids == ("mb",) and not errors[0].fatal
    assert "seq_len" in errors[0].message
    assert [o.rid for o in result.outputs] == ["ma"]
    assert result.outputs[0].draft_ids.tolist() == greedy(hf_model, a)
    # The dropped request is forgotten until re-sent with its prompt.
    result = step(client, DraftRequest(2, 1, (DraftEntry("mb", [8], len(b), prompt_ids=b[:-1]),)))
    assert result.outputs[0].draft_ids.tolist() == greedy(hf_model, b)
    step(client, DraftRequest(3, 0, removed_rids=("ma", "mb")))


def test_removed_rids_are_freed(client: DraftServerClient) -> None:
    step(client, DraftRequest(0, 0, (DraftEntry("r1", [], 3, prompt_ids=[1, 2, 3]),)))
    # Freed before the entries are read: r1 is unknown again.
    result = step(client, DraftRequest(1, 0, (DraftEntry("r1", [4], 4),), removed_rids=("r1",)))
    assert result.outputs == ()
    errors = client.take_errors()
    assert len(errors) == 1 and errors[0].rids == ("r1",) and "unknown" in errors[0].message


def test_sampled_drafts_return_their_distribution(client: DraftServerClient, hf_model) -> None:
    prompt, temperature = [3, 14, 15, 92, 65], 0.7
    entries = (
        DraftEntry("s", [], len(prompt), prompt, temperature=temperature),
        DraftEntry("sg", [], len(prompt), prompt),  # greedy in the same batch
    )
    outputs = step(client, DraftRequest(0, 0, entries)).by_rid()
    out = outputs["s"]
    probs = out.draft_probs
    assert probs is not None and probs.shape == (NUM_STEPS, hf_model.config.vocab_size)
    assert probs.dtype == np.float32
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, atol=1e-4)
    tokens = out.draft_ids.tolist()
    assert all(probs[i, t] > 0 for i, t in enumerate(tokens))
    for i in range(NUM_STEPS):  # q_i = softmax(logits / T) after the prompt and drafts < i
        want = torch.softmax(next_logits(hf_model, prompt + tokens[:i]) / temperature, dim=-1)
        np.testing.assert_allclose(probs[i], want.numpy(), atol=1e-5)
    assert outputs["sg"].draft_probs is None
    assert outputs["sg"].draft_ids.tolist() == greedy(hf_model, prompt)
    step(client, DraftRequest(1, 0, removed_rids=("s", "sg")))


def test_collect_skips_results_of_abandoned_steps(client: DraftServerClient) -> None:
    entry = DraftEntry("st", [], 3, prompt_ids=[9, 8, 7])
    client.submit(DraftRequest(10, 0, (entry,)))  # the caller gave up waiting for step 10
    client.submit(DraftRequest(11, 0, removed_rids=("st",)))
    stale = client.num_stale
    result = client.collect(STEP_TIMEOUT_S, step_id=11)
    assert result is not None and result.step_id == 11 and client.num_stale == stale + 1


def test_killed_server_is_detected_and_restarted(client: DraftServerClient, hf_model) -> None:
    step(client, DraftRequest(0, 0, (DraftEntry("k", [], 3, prompt_ids=[5, 6, 7]),)))
    old_pid = client.pid
    os.kill(old_pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while client.alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not client.alive()
    with pytest.raises(DraftServerError, match="exited"):
        client.collect(1.0)
    with pytest.raises(DraftServerError, match="exited"):
        client.submit(DraftRequest(1, 0, (DraftEntry("k", [8], 4),)))
    generation = client.generation
    client.restart()
    assert client.alive() and client.pid != old_pid and client.generation == generation + 1
    assert socket_files(client) == []
    # The fresh server holds nothing: "k" must come again with its prompt.
    step(client, DraftRequest(1, 0, (DraftEntry("k", [8], 4),)))
    assert client.take_errors()[0].rids == ("k",)
    result = step(client, DraftRequest(2, 0, (DraftEntry("k", [8], 4, prompt_ids=[5, 6, 7]),)))
    assert result.outputs[0].draft_ids.tolist() == greedy(hf_model, [5, 6, 7, 8])


# -- start-up failures ------------------------------------------------------------------------


def test_handshake_timeout_is_a_clear_error(ipc_dir: str) -> None:
    c = DraftServerClient(make_hello(), "slow", ipc_dir=ipc_dir, handshake_timeout_s=0.5)
    with pytest.raises(DraftServerError, match=r"no Ready within 0\.5s"):
        c.start()
    assert not c.alive() and c.pid is None
    assert socket_files(c) == []
    c.close()


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"draft_model_path": "/no/such/draft-model"}, "does not exist"),
        ({"draft_model_path": "sgl-spec/no-such-draft"}, "unknown model name"),
        ({"device": "gpu:1"}, "draft device must be"),
        ({"topk": 2}, "topk 2"),
    ],
)
def test_bad_hello_is_refused_before_spawning(ipc_dir, overrides, match) -> None:
    c = DraftServerClient(make_hello(**overrides), "refused", ipc_dir=ipc_dir)
    with pytest.raises(DraftServerError, match=match):
        c.start()
    assert c.pid is None and not c.alive()


def test_corrupt_model_is_a_clear_error(tmp_path, ipc_dir: str) -> None:
    """A model directory the server cannot load: its fatal ErrorReport ends the handshake."""
    corrupt = tmp_path / "corrupt-draft"
    corrupt.mkdir()
    (corrupt / "config.json").write_text("{not json")
    hello = make_hello(draft_model_path=str(corrupt))
    c = DraftServerClient(hello, "bad", ipc_dir=ipc_dir, handshake_timeout_s=START_TIMEOUT_S)
    with pytest.raises(DraftServerError, match="failed to start: .*could not load .*corrupt-draft"):
        c.start()
    assert not c.alive() and c.pid is None
    assert socket_files(c) == []
    c.close()
