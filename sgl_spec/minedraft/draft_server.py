"""The MineDraft draft-server process: the Drafter of paper §5.2 on its own device.

Started by ``DraftServerClient`` (``client.py``) as ``python -m sgl_spec.minedraft.draft_server
--instance-id ID --parent-pid PID``. It binds its inbox and connects its outbox (the addresses of
``draft_server_addresses(ID)``), waits for ``Hello``, loads the draft model on ``Hello.device``
and answers ``Ready``. Then, per ``DraftRequest`` (one draft batch of one SD step):

1. frees the KV of ``removed_rids`` (finished / aborted / preempted, the recycle of §5.1);
2. starts new requests (``prompt_ids`` set) and appends the verified ``appended_ids`` of the
   others, checking ``seq_len``: a mismatch drops that request and lists it in a non-fatal
   ``ErrorReport`` (the scheduler re-sends it with its prompt) while the rest are drafted;
3. drafts ``Hello.num_steps`` tokens per request (``draft_model.py``), rolling back the drafts'
   KV, and answers one ``DraftResult`` (after the ``ErrorReport``, if any).

``Shutdown`` ends it; so does the death of ``--parent-pid`` (a watchdog thread), so a crashed
scheduler never leaves a draft process holding a device.

Devices (``Hello.device``): ``cuda:N`` -- GPU N as the scheduler process numbers them;
``cpu`` -- every core of the affinity the process inherits; ``cpu:N`` -- a core set of N cores
of its own: the *last* N cores of the inherited affinity (``cpu_core_set``), pinned with
``sched_setaffinity``, N torch threads. Either CPU form hands its core list to SGLang's CPU
bootstrap (``SGLANG_CPU_OMP_THREADS_BIND``), which may bind one OpenMP thread per listed core.
The scheduler keeps its own work off a ``cpu:N`` set by taking the other cores (the same
function tells it which).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time

from sgl_spec.minedraft.channel import MessageChannel, draft_server_addresses
from sgl_spec.minedraft.devices import DeviceSpec, cpu_core_set, parse_device
from sgl_spec.minedraft.messages import (
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

logger = logging.getLogger("sgl_spec.minedraft.draft_server")
POLL_S = 0.5  # inbox poll / parent check interval
# Debugging aid: SGLSPEC_MINEDRAFT_CHECK_KV=1 checks the KV accounting after every request
# (a leak or double free becomes a fatal ErrorReport).
CHECK_KV_ENV = "SGLSPEC_MINEDRAFT_CHECK_KV"
EXIT_PARENT_DIED = 3
# Positions a hosted SpecBlock drafter accepts per request (its KV grows with the request; the
# target's own context length is what really bounds it).
SPECBLOCK_MAX_CONTEXT = 1 << 20


def apply_device(spec: DeviceSpec) -> str:
    """Place this process on ``spec`` (before SGLang loads anything); returns a description."""
    if spec.kind == "cuda":
        return spec.torch_device
    import torch

    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    available = sorted(os.sched_getaffinity(0))
    cores = available if spec.index is None else cpu_core_set(spec.index, available)
    if spec.index is not None:
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(len(cores))
    # SGLang's CPU bootstrap binds OpenMP threads to this list (default: a whole NUMA node).
    os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores))
    label = "cpu" if spec.index is None else f"cpu:{spec.index}"
    return f"{label} (cores {','.join(map(str, cores))})"


class DraftServer:
    """Serves DraftRequests with a loaded ``DraftModel`` (``handle`` computes the replies,
    ``serve`` moves messages)."""

    def __init__(self, hello: Hello, model) -> None:
        self.hello = hello
        self.model = model
        self.check_kv = os.environ.get(CHECK_KV_ENV, "0") not in ("", "0")

    def handle(self, request: DraftRequest) -> tuple[DraftResult, ErrorReport | None]:
        from sgl_spec.minedraft.draft_model import DraftStateError

        start = time.perf_counter()
        for rid in request.removed_rids:
            self.model.free(rid)
        errors: dict[str, str] = {}
        ready: list[DraftEntry] = []
        for entry in request.entries:
            try:
                self._update(entry)
                ready.append(entry)
            except DraftStateError as exc:
                self.model.free(entry.rid)
                errors[entry.rid] = str(exc)
        outputs: list[DraftOutput] = []
        if ready:
            try:
                drafts = self.model.draft(
                    [e.rid for e in ready], [float(e.temperature) for e in ready]
                )
                outputs = [
                    DraftOutput(rid=e.rid, draft_ids=ids, draft_probs=probs)
                    for e, (ids, probs) in zip(ready, drafts, strict=True)
                ]
            except Exception as exc:  # KV full, a model failure: the batch, not the server
                logger.exception("step %d: drafting failed", request.step_id)
                errors.update({e.rid: f"drafting failed: {exc}" for e in ready})
        result = DraftResult(
            step_id=request.step_id,
            batch_id=request.batch_id,
            outputs=tuple(outputs),
            draft_time_s=time.perf_counter() - start,
        )
        report = None
        if errors:
            message = "; ".join(errors.values())
            report = ErrorReport(message=message, step_id=request.step_id, rids=tuple(errors))
        return result, report

    def _update(self, entry: DraftEntry) -> None:
        from sgl_spec.minedraft.draft_model import DraftStateError

        appended = entry.appended_ids.tolist()
        if entry.is_new:
            tokens = [*entry.prompt_ids.tolist(), *appended]
            if entry.seq_len != len(tokens):
                raise DraftStateError(
                    f"{entry.rid}: seq_len {entry.seq_len} != {len(tokens)} tokens sent"
                )
            self.model.add(entry.rid, tokens, entry.features)
            return
        if entry.rid not in self.model:
            raise DraftStateError(f"{entry.rid}: unknown request (never sent with its prompt)")
        held = self.model.seq_len(entry.rid)
        if held + len(appended) != entry.seq_len:
            raise DraftStateError(
                f"{entry.rid}: seq_len {entry.seq_len} != {held} held + {len(appended)} appended"
            )
        self.model.append(entry.rid, appended, entry.features)

    def serve(self, inbox: MessageChannel, outbox: MessageChannel) -> None:
        """Answer DraftRequests until Shutdown."""
        while True:
            try:
                msg = inbox.recv(timeout_s=POLL_S)
            except MessageError as exc:
                outbox.send(ErrorReport(message=f"draft server got a bad frame: {exc}"))
                continue
            if msg is None:
                continue
            if isinstance(msg, Shutdown):
                logger.info("shutdown: %s", msg.reason or "requested")
                return
            if isinstance(msg, DraftRequest):
                result, report = self.handle(msg)
                if report is not None:
                    outbox.send(report)
                if self.check_kv:
                    try:
                        self.model.check_kv_accounting()
                    except AssertionError as exc:
                        outbox.send(ErrorReport(message=str(exc), step_id=msg.step_id, fatal=True))
                        return
                outbox.send(result)
            else:
                outbox.send(ErrorReport(message=f"unexpected {type(msg).__name__} while serving"))


def cpu_kv_tokens(hello: Hello, context_len: int) -> int:
    """Draft KV slots on a CPU host, where they come out of the RAM the target's KV pool is
    sized from: every request at full context, or -- when the target's token budget is known
    (``Hello.max_total_tokens``) -- that budget plus each request's draft positions, since the
    draft server only ever holds the target's verified tokens and its own drafts."""
    max_requests = 2 * hello.max_batch_size
    full = max_requests * (context_len + hello.num_steps)
    if hello.max_total_tokens <= 0:
        return full
    return min(full, hello.max_total_tokens + max_requests * (hello.num_steps + 1))


def load(hello: Hello):
    """Place the process, then boot SGLang's ModelRunner for the draft model (or load the
    SpecBlock drafter, which runs as a plain PyTorch module)."""
    from sgl_spec.models.registry import resolve_model_path

    if hello.topk != 1:
        raise ValueError(f"topk {hello.topk}: this draft server drafts chains (topk 1) only")
    spec = parse_device(hello.device)
    model_path = resolve_model_path(hello.draft_model_path)
    description = apply_device(spec)
    if hello.drafter == "specblock":
        from sgl_spec.minedraft.specblock_host import SpecBlockChainModel

        if spec.kind == "cuda":
            import torch

            torch.cuda.set_device(spec.index or 0)
        model = SpecBlockChainModel.load(
            model_path, spec.torch_device, hello.num_steps, SPECBLOCK_MAX_CONTEXT
        )
        return model, f"{description}, SpecBlock drafter"
    from transformers import AutoConfig

    from sgl_spec.minedraft.draft_model import DraftModel, build_model_runner

    config = AutoConfig.from_pretrained(model_path)
    context_len = int(getattr(config, "max_position_embeddings", 4096))
    max_requests = 2 * hello.max_batch_size  # both batches (§5.1)
    # CUDA: SGLang sizes the pool from the draft device's memory.
    kv_tokens = cpu_kv_tokens(hello, context_len) if spec.kind == "cpu" else None
    runner = build_model_runner(
        model_path,
        spec.torch_device,
        max_requests=max_requests,
        max_total_tokens=kv_tokens,
        seed=hello.seed,
    )
    if kv_tokens is not None:
        budget = hello.max_total_tokens or f"{max_requests} requests x {context_len} context"
        description += f", KV pool {kv_tokens} tokens (target budget {budget} + draft positions)"
    return DraftModel(runner, num_steps=hello.num_steps, seed=hello.seed), description


def _watch_parent(parent_pid: int) -> None:
    """Exit when the scheduler that started us is gone (we get re-parented)."""
    while True:
        if os.getppid() != parent_pid:
            logger.warning("parent %d died; exiting", parent_pid)
            os._exit(EXIT_PARENT_DIED)
        time.sleep(POLL_S)


def _wait_hello(inbox: MessageChannel, outbox: MessageChannel) -> Hello | None:
    while True:
        try:
            msg = inbox.recv(timeout_s=POLL_S)
        except MessageError as exc:
            outbox.send(ErrorReport(message=f"bad handshake frame: {exc}", fatal=True))
            return None
        if isinstance(msg, Hello):
            return msg
        if isinstance(msg, Shutdown):
            return None
        if msg is not None:
            outbox.send(ErrorReport(message=f"expected Hello, got {type(msg).__name__}"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--instance-id", required=True)
    parser.add_argument("--ipc-dir", default=None)
    parser.add_argument("--parent-pid", type=int, default=os.getppid())
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        format="[%(asctime)s minedraft-draft-server] %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    threading.Thread(target=_watch_parent, args=(args.parent_pid,), daemon=True).start()
    import zmq

    # Before anything imports sgl_kernel (also done by the .pth start-up hook where installed).
    import sgl_spec.cpu_kernels.boot  # noqa: F401
    from sgl_spec.config import process_config
    from sgl_spec.patches import apply_patches

    # the patches every SGLang process of ours gets (SGLang's plugin loading never runs in this
    # process): e.g. on a CUDA host without cutlass no Llama model loads without them
    apply_patches(process_config())

    addresses = draft_server_addresses(args.instance_id, args.ipc_dir)
    # The scheduler sends first, so it connects (its sends queue until we bind) and we bind.
    inbox = MessageChannel(addresses.to_draft_server, zmq.PULL, bind=True)
    outbox = MessageChannel(addresses.to_scheduler, zmq.PUSH, bind=False)
    try:
        hello = _wait_hello(inbox, outbox)
        if hello is None:
            return 1
        try:
            model, description = load(hello)
        except Exception as exc:
            logger.exception("loading the draft model failed")
            outbox.send(
                ErrorReport(
                    message=f"draft server could not load {hello.draft_model_path!r} on"
                    f" {hello.device}: {type(exc).__name__}: {exc}",
                    fatal=True,
                )
            )
            return 1
        outbox.send(Ready(pid=os.getpid(), device=description))
        logger.info("ready: %s on %s", hello.draft_model_path, description)
        DraftServer(hello, model).serve(inbox, outbox)
        return 0
    finally:
        inbox.close()
        outbox.close(linger_s=2.0)  # let a last reply (ErrorReport) reach the scheduler


if __name__ == "__main__":
    sys.exit(main())
