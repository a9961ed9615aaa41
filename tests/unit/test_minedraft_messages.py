"""Scheduler <-> MineDraft draft-server messages: round trips, rejection of bad frames, and the
ZMQ transport over ipc:// between two threads."""

from __future__ import annotations

import dataclasses
import struct
import tempfile
import threading
import time

import msgspec
import numpy as np
import pytest
import torch

from sgl_spec.minedraft import channel, codec
from sgl_spec.minedraft import messages as M
from sgl_spec.minedraft.codec import decode, encode
from sgl_spec.minedraft.messages import (
    PROTOCOL_VERSION,
    DraftEntry,
    DraftOutput,
    DraftRequest,
    DraftResult,
    ErrorReport,
    Hello,
    MessageError,
    Ready,
    Shutdown,
)


def assert_same(a: object, b: object) -> None:
    """Deep equality for messages: same type, arrays equal in value, dtype and shape."""
    assert type(a) is type(b)
    if isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert np.array_equal(a, b)
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name))
    elif isinstance(a, tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b


def example_messages() -> list[M.Message]:
    rng = np.random.default_rng(0)
    return [
        Hello(
            "/models/draft", "cuda:1", num_steps=4, num_draft_tokens=5, topk=1, max_batch_size=16
        ),
        DraftRequest(
            step_id=7,
            batch_id=1,
            entries=(
                DraftEntry("new-req", [42], seq_len=6, prompt_ids=[1, 2, 3, 4, 5], temperature=0.7),
                DraftEntry("old-req", torch.tensor([9, 8, 7]), seq_len=123),
                DraftEntry("no-accept", np.zeros(0, dtype=np.int64), seq_len=50),
            ),
            removed_rids=("done-1", "aborted-2"),
        ),
        DraftRequest(step_id=0, batch_id=0),
        Shutdown("bye"),
        Shutdown(),
        Ready(pid=1234, device="cpu:1"),
        DraftResult(
            step_id=7,
            batch_id=1,
            outputs=(
                DraftOutput("greedy", [5, 6, 7, 8]),
                DraftOutput("sampled", [1, 2, 3, 4], rng.random((4, 50), dtype=np.float32)),
            ),
            draft_time_s=0.0125,
        ),
        DraftResult(step_id=8, batch_id=0),
        ErrorReport("seq_len mismatch", step_id=3, rids=("a", "b")),
        ErrorReport("out of memory", fatal=True),
    ]


@pytest.mark.parametrize("msg", example_messages(), ids=lambda m: type(m).__name__)
def test_round_trip(msg: M.Message) -> None:
    frame = encode(msg)
    assert isinstance(frame, bytes)
    assert_same(decode(frame), msg)
    assert_same(decode(bytearray(frame)), msg)


def test_every_message_type_is_covered() -> None:
    assert {type(m) for m in example_messages()} == set(codec._TAGS)


def test_arrays_are_raw_int32_and_float32() -> None:
    n = 200_000
    prompt = torch.arange(n) % 150_000  # int64 tensor
    frame = encode(DraftRequest(1, 0, (DraftEntry("long", [], seq_len=n, prompt_ids=prompt),)))
    assert 4 * n < len(frame) < 4 * n + 256  # raw int32 plus field names, not a msgpack list
    entry = decode(frame).entries[0]
    assert entry.prompt_ids.dtype == np.int32 and entry.appended_ids.shape == (0,)
    assert torch.equal(torch.from_numpy(entry.prompt_ids).long(), prompt)  # writable, no warning
    assert entry.is_new and entry.seq_len == n

    probs = torch.softmax(torch.randn(3, 1000), dim=-1).to(torch.bfloat16)
    out = decode(encode(DraftResult(2, 1, (DraftOutput("s", torch.tensor([1, 2, 3]), probs),))))
    got = out.by_rid()["s"].draft_probs
    assert got.dtype == np.float32 and got.shape == (3, 1000)
    assert torch.equal(torch.from_numpy(got), probs.float())


def test_version_mismatch_is_rejected() -> None:
    frame = bytearray(encode(Shutdown()))
    struct.pack_into("<H", frame, 2, PROTOCOL_VERSION + 1)
    with pytest.raises(MessageError, match=f"protocol version {PROTOCOL_VERSION + 1}"):
        decode(bytes(frame))


def test_bad_header_is_rejected() -> None:
    body = encode(Ready(pid=1, device="cpu"))
    with pytest.raises(MessageError, match="unknown message type tag 99"):
        decode(body[:4] + bytes([99]) + body[5:])
    with pytest.raises(MessageError, match="not a MineDraft message"):
        decode(b"XX" + body[2:])
    with pytest.raises(MessageError, match="truncated frame"):
        decode(b"MD")


@pytest.mark.parametrize("msg", example_messages()[1:2] + example_messages()[6:7])
def test_every_truncation_is_rejected(msg: M.Message) -> None:
    frame = encode(msg)
    for cut in range(len(frame)):
        with pytest.raises(MessageError):
            decode(frame[:cut])
    with pytest.raises(MessageError, match="trailing"):
        decode(frame + b"\x00")


def raw_frame(tag: int, body: object) -> bytes:
    """A frame with a valid header around an arbitrary msgpack body (a buggy peer)."""
    return struct.pack("<2sHB", b"MD", PROTOCOL_VERSION, tag) + msgspec.msgpack.encode(body)


def test_malformed_bodies_are_rejected() -> None:
    tag = codec._TAGS[DraftResult]
    good = {"step_id": 1, "batch_id": 0, "outputs": []}
    assert decode(raw_frame(tag, good)).step_id == 1
    cases = {
        "step_id": {**good, "step_id": "one"},  # wrong type
        "batch_id must be 0 or 1": {**good, "batch_id": 2},  # violates an invariant
        "missing required field": {"step_id": 1},
        "expected ndarray": {**good, "outputs": [{"rid": "a", "draft_ids": [1, 2]}]},
        "unknown array encoding": {
            **good,
            "outputs": [{"rid": "a", "draft_ids": msgspec.msgpack.Ext(9, b"\x01\x00\x00\x00\x00")}],
        },
        "does not match shape": {
            **good,
            "outputs": [{"rid": "a", "draft_ids": msgspec.msgpack.Ext(1, b"\x01\x03\x00\x00\x00")}],
        },
    }
    for match, body in cases.items():
        with pytest.raises(MessageError, match=match):
            decode(raw_frame(tag, body))


def test_construction_checks_invariants() -> None:
    with pytest.raises(MessageError, match="rows"):
        DraftOutput("a", [1, 2, 3], np.ones((2, 10), dtype=np.float32))
    with pytest.raises(MessageError, match="1 dimension"):
        DraftEntry("a", [[1, 2]], seq_len=2)
    with pytest.raises(MessageError, match="seq_len"):
        DraftEntry("a", [1, 2], seq_len=3, prompt_ids=[1, 2])
    with pytest.raises(MessageError, match="duplicate"):
        DraftRequest(1, 0, (DraftEntry("a", [], 1), DraftEntry("a", [], 1)))
    with pytest.raises(MessageError, match="num_steps"):
        Hello("d", "cpu", num_steps=0, num_draft_tokens=1, topk=1, max_batch_size=1)
    with pytest.raises(MessageError, match="max_total_tokens"):
        Hello("d", "cpu", 1, 2, 1, 1, max_total_tokens=-1)
    with pytest.raises(MessageError, match="not a message type"):
        encode(DraftEntry("a", [], 1))  # a part, not a message


def test_addresses_are_derived_in_one_place() -> None:
    a = channel.draft_server_addresses("30000-dp0", ipc_dir="/tmp/x")
    assert a == channel.draft_server_addresses("30000-dp0", ipc_dir="/tmp/x")
    assert a.to_draft_server.startswith("ipc:///tmp/x/") and a.to_scheduler.startswith("ipc://")
    assert a.to_draft_server != a.to_scheduler
    assert (
        channel.draft_server_addresses("30000-dp1", ipc_dir="/tmp/x").to_scheduler != a.to_scheduler
    )
    with pytest.raises(ValueError, match="instance_id"):
        channel.draft_server_addresses("../evil")
    with pytest.raises(ValueError, match="too long"):
        channel.draft_server_addresses("a", ipc_dir="/tmp/" + "d" * 120)


def test_transport_between_two_threads() -> None:
    import zmq

    addrs = channel.draft_server_addresses("test", ipc_dir=tempfile.mkdtemp(prefix="sgl"))
    to_server = channel.MessageChannel(addrs.to_draft_server, zmq.PUSH, bind=True)
    from_server = channel.MessageChannel(addrs.to_scheduler, zmq.PULL, bind=True)
    seen: list[M.Message] = []

    def draft_server() -> None:
        with (
            channel.MessageChannel(addrs.to_draft_server, zmq.PULL, bind=False) as inbox,
            channel.MessageChannel(addrs.to_scheduler, zmq.PUSH, bind=False) as outbox,
        ):
            while (msg := inbox.recv(timeout_s=5.0)) is not None:
                seen.append(msg)
                if isinstance(msg, Hello):
                    outbox.send(Ready(pid=42, device=msg.device))
                elif isinstance(msg, DraftRequest):
                    outs = tuple(
                        DraftOutput(e.rid, e.appended_ids[-1:].repeat(3)) for e in msg.entries
                    )
                    outbox.send(DraftResult(msg.step_id, msg.batch_id, outs))
                else:
                    return

    thread = threading.Thread(target=draft_server, daemon=True)
    thread.start()
    try:
        start = time.monotonic()
        assert from_server.recv(timeout_s=0.2) is None  # nothing sent yet: times out
        assert time.monotonic() - start >= 0.15
        to_server.send(
            Hello("d", "cpu:1", num_steps=3, num_draft_tokens=4, topk=1, max_batch_size=2)
        )
        ready = from_server.recv(timeout_s=10.0)
        assert isinstance(ready, Ready) and (ready.pid, ready.device) == (42, "cpu:1")
        request = DraftRequest(5, 1, (DraftEntry("r", [11, 12], seq_len=9, prompt_ids=range(7)),))
        to_server.send(request)
        result = from_server.recv(timeout_s=10.0)
        assert isinstance(result, DraftResult) and (result.step_id, result.batch_id) == (5, 1)
        assert result.by_rid()["r"].draft_ids.tolist() == [12, 12, 12]
        to_server.send(Shutdown())
        thread.join(timeout=10.0)
        assert not thread.is_alive()
        assert [type(m) for m in seen] == [Hello, DraftRequest, Shutdown]
        assert_same(seen[1], request)

        # A garbage frame from a buggy peer surfaces as MessageError, and the channel survives.
        raw = zmq.Context.instance().socket(zmq.PUSH)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(addrs.to_scheduler)
        raw.send(b"MD\x01\x00\x12garbage")
        with pytest.raises(MessageError):
            from_server.recv(timeout_s=10.0)
        raw.send(encode(ErrorReport("late")))
        assert isinstance(from_server.recv(timeout_s=10.0), ErrorReport)
        raw.close()
    finally:
        to_server.close()
        from_server.close()


def test_cpu_draft_kv_is_bounded_by_the_target_budget() -> None:
    """On a CPU host the draft server's KV comes out of the RAM the target's pool is sized from:
    with the target's --max-total-tokens known it holds that budget plus each request's draft
    positions (both batches), never more than every request at full context."""
    from sgl_spec.minedraft.draft_server import cpu_kv_tokens

    hello = Hello("d", "cpu:1", num_steps=3, num_draft_tokens=4, topk=1, max_batch_size=128)
    assert cpu_kv_tokens(hello, context_len=2048) == 256 * (2048 + 3)  # budget unknown
    bounded = Hello("d", "cpu:1", 3, 4, 1, 128, max_total_tokens=16384)
    assert cpu_kv_tokens(bounded, context_len=2048) == 16384 + 256 * 4
    huge = Hello("d", "cpu:1", 3, 4, 1, 2, max_total_tokens=10**9)
    assert cpu_kv_tokens(huge, context_len=100) == 4 * 103
    assert decode(encode(bounded)).max_total_tokens == 16384
