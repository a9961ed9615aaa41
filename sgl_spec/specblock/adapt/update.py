"""Cost-aware adaptation, the training side (paper §3.4 "Asynchronous updates and drift
control", Algorithm 1 lines 14-16 and 23, App. A.3). No SGLang import.

- ``TrainExample``: a window of consecutive committed positions of one served request -- the
  target's features the drafter was conditioned on and the verified tokens -- trained as in
  offline training's pass 1 (``trainer.chain_forward`` with one block per chain): block ``p``
  conditions on ``(features[p], x[p])`` and predicts ``x[p+1..p+K]``, under the valid-prefix mask
  (Eq. 5) and with the rank-head loss (Eq. 7). The window sees only its own earlier positions,
  not the whole served prefix (our simplification: bounded cost per example).
- ``adapt_loss``: that objective plus ``lambda KL(p_theta || p_theta0)`` against the
  pre-deployment drafter at the same positions.
- ``DrafterCopies``: ``theta_inf`` (the module the worker drafts with), ``theta_train`` (an fp32
  copy the trainer steps), ``theta_0`` (frozen) and the last good weights for rollbacks. Weights
  move into ``theta_inf`` only in ``sync``, called by the serving thread between decode steps,
  so a draft never reads half-copied weights.
- ``BackgroundTrainer``: one daemon thread running updates on ``theta_train``. On a CPU host it
  competes with serving for the same cores, which is why an update is a couple of optimizer
  steps over a few short windows (``AdaptConfig``). The thread also runs single-threaded
  (``torch.set_num_threads(1)`` from it: OpenMP's thread count is per calling thread) and
  lowers its own scheduling priority (``trainer_nice``; Linux niceness is per thread): serving
  keeps the cores and the update runs in what it leaves, the CPU counterpart of the paper's
  separate training stream. Both matter: a 2-thread OpenMP team in the trainer makes GNU
  OpenMP see more threads than cores and throttle the spin-wait of *every* team, serving's
  included (niceness or not; benchmarks/omp_contention.py), and a single un-niced thread still
  preempts serving's workers.
  ``set_num_threads`` also sets the count that threads created later (and threads that have
  not run a parallel op yet) start with, so the thread that starts the trainer fixes its own
  count first and, once the trainer has fixed its own, sets the default back to it.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import os
import queue
import threading
from dataclasses import dataclass

import torch

from sgl_spec.specblock.adapt.policy import Action, AdaptConfig
from sgl_spec.specblock.layout import IGNORE_INDEX
from sgl_spec.specblock.model import SpecBlockDrafter
from sgl_spec.specblock.training.losses import chain_loss, target_to_draft_map
from sgl_spec.specblock.training.trainer import chain_forward

logger = logging.getLogger(__name__)
STARTUP_TIMEOUT_S = 30.0  # the trainer thread fixing its thread count takes milliseconds
HEAD_MODULES = ("lm_head", "rank_head")  # §3.4: the output-side pathway of the head action


@dataclass
class TrainExample:
    features: torch.Tensor  # [T, 3*d_target] target features at each committed position
    tokens: torch.Tensor  # [T] committed token ids
    num_starts: int  # W: blocks start at positions 0..W-1 (the rest only supply labels)

    def __post_init__(self) -> None:
        t = self.tokens.shape[0]
        if self.features.shape[0] != t or not 1 <= self.num_starts < t:
            raise ValueError(
                f"TrainExample needs features for each of {t} tokens and 1 <= num_starts < {t};"
                f" got {tuple(self.features.shape)}, num_starts={self.num_starts}"
            )


def cut_windows(
    features: torch.Tensor,  # [T, F] target features of committed positions
    tokens: torch.Tensor,  # [T] committed token ids
    window: int,  # W
    block_size: int,  # K
) -> tuple[list[TrainExample], int]:
    """Cut ``TrainExample`` windows of ``W + K`` positions, one starting every ``W`` positions
    (the last ``K`` of a window only label its blocks, and are the next window's first
    starts). Returns the windows and the position where the uncut tail begins: what a stream
    keeps to cut more from once further positions arrive."""
    span = window + block_size
    out = []
    start = 0
    while start + span <= tokens.shape[0]:
        out.append(
            TrainExample(features[start : start + span], tokens[start : start + span], window)
        )
        start += window
    return out, start


@dataclass
class AdaptLoss:
    total: torch.Tensor  # scalar
    draft: torch.Tensor  # scalar, Eq. (7) draft part
    kl: torch.Tensor  # scalar, KL(p_theta || p_theta0) per labelled position


def _stack(examples: list[TrainExample], device: torch.device) -> tuple[torch.Tensor, ...]:
    shapes = {(e.tokens.shape[0], e.num_starts) for e in examples}
    if len(shapes) != 1:
        raise ValueError(f"examples of one update need one window shape, got {sorted(shapes)}")
    features = torch.stack([e.features for e in examples]).to(device, torch.float32)
    tokens = torch.stack([e.tokens for e in examples]).to(device, torch.long)
    return features, tokens, torch.arange(examples[0].num_starts, device=device)


def adapt_loss(
    drafter: SpecBlockDrafter,
    reference: SpecBlockDrafter,
    examples: list[TrainExample],
    kl_weight: float,
) -> AdaptLoss:
    """Algorithm 1 line 14's objective on ``examples`` (module docstring)."""
    if not examples:
        raise ValueError("adapt_loss needs at least one example")
    device = drafter.d2t.device
    features, tokens, starts = _stack(examples, device)
    cuts = torch.zeros(tokens.shape[0], starts.numel(), 0, dtype=torch.long, device=device)
    out = chain_forward(drafter, features, tokens, starts, cuts)
    t2d = target_to_draft_map(drafter.d2t, drafter.config.target_vocab_size)
    losses = chain_loss(out.logits, out.rank_logits, out.labels, t2d, cuts)
    with torch.no_grad():
        ref_logits = chain_forward(reference, features, tokens, starts, cuts).logits[0].float()
    logp = out.logits[0].float().log_softmax(-1)  # [n, W, K, V_d]
    kl = (logp.exp() * (logp - ref_logits.log_softmax(-1))).sum(-1)  # [n, W, K]
    labelled = out.labels[0] != IGNORE_INDEX
    kl = (kl * labelled).sum() / labelled.sum().clamp_min(1)
    return AdaptLoss(losses.total + kl_weight * kl, losses.draft, kl)


def set_trainable(drafter: SpecBlockDrafter, action: Action) -> list[torch.nn.Parameter]:
    """Head: only ``lm_head`` and the rank head take gradients, so the backward never enters
    the trunk; full: every parameter but the frozen target embedding (App. A.1)."""
    if action is Action.SKIP:
        raise ValueError("skip trains nothing")
    params = []
    for name, p in drafter.named_parameters():
        if name.startswith("embed_tokens."):
            p.requires_grad_(False)
            continue
        on = action is Action.FULL or name.split(".")[0] in HEAD_MODULES
        p.requires_grad_(on)
        if on:
            params.append(p)
    return params


class DrafterCopies:
    """theta_inf / theta_train / theta_0 and the last good weights (module docstring)."""

    def __init__(self, drafter: SpecBlockDrafter, cfg: AdaptConfig) -> None:
        self.inf = drafter
        self.train = copy.deepcopy(drafter).float().train()
        self.ref = copy.deepcopy(drafter).float().eval()
        for p in self.ref.parameters():
            p.requires_grad_(False)
        self.cfg = cfg
        self.lock = threading.Lock()
        self.good = self._snapshot(self.inf)
        self.version = 0  # trained updates finished in theta_train
        self.synced = 0  # the version theta_inf holds
        self._new_optimizer()

    def _new_optimizer(self) -> None:
        params = [p for n, p in self.train.named_parameters() if not n.startswith("embed_tokens")]
        self.optimizer = torch.optim.AdamW(params, lr=self.cfg.lr, weight_decay=0.0)

    @staticmethod
    def _snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in module.state_dict().items()}

    def update(
        self,
        action: Action,
        examples: list[TrainExample],
        stream: torch.cuda.Stream | None = None,
    ) -> float:
        """Step ``theta_train`` ``steps_per_update`` times (holding the lock per step, so a
        ``sync`` never sees a half-applied step); returns the last loss. An update that raises
        -- a non-finite loss or weights included -- leaves nothing behind: ``discard`` undoes
        the steps it already took, so neither it nor a later update publishes them."""
        loss_value = float("nan")
        try:
            for _ in range(self.cfg.steps_per_update):
                with self.lock:
                    params = set_trainable(self.train, action)
                    self.optimizer.zero_grad(set_to_none=True)
                    loss = adapt_loss(self.train, self.ref, examples, self.cfg.kl_weight)
                    loss_value = float(loss.total.detach())
                    if not math.isfinite(loss_value):
                        raise FloatingPointError(f"non-finite adaptation loss {loss_value}")
                    loss.total.backward()
                    torch.nn.utils.clip_grad_norm_(params, 0.5)  # the offline clip (§4.1)
                    self.optimizer.step()
                    if not all(bool(torch.isfinite(p).all()) for p in params):
                        raise FloatingPointError("non-finite drafter weights after a step")
            if stream is not None:
                stream.synchronize()
        except BaseException:
            self.discard()
            raise
        with self.lock:
            self.version += 1
        return loss_value

    @property
    def ready(self) -> bool:
        return self.version > self.synced

    def sync(self, block: bool = False) -> bool:
        """Algorithm 1 line 16: copy ``theta_train`` into ``theta_inf`` if a newer update is
        ready and the trainer is between steps (never waits unless ``block``)."""
        if not self.ready or not self.lock.acquire(blocking=block):
            return False
        try:
            with torch.no_grad():
                pairs = zip(self.inf.named_parameters(), self.train.parameters(), strict=True)
                for (name, dst), src in pairs:
                    if not name.startswith("embed_tokens."):  # frozen, never trained
                        dst.copy_(src.to(dst.dtype))
            self.synced = self.version
        finally:
            self.lock.release()
        return True

    def discard(self) -> None:
        """``theta_train`` back to the weights serving drafts (``theta_inf``: every finished
        update is synced before the next one starts) and a fresh optimizer, whose moments
        hold the discarded steps."""
        with self.lock:
            weights = self.inf.state_dict()
            self.train.load_state_dict(
                {k: v.float() if v.is_floating_point() else v for k, v in weights.items()}
            )
            self._new_optimizer()

    def mark_good(self) -> None:
        self.good = self._snapshot(self.inf)

    def roll_back(self) -> None:
        """Algorithm 1 line 23: ``theta_inf`` and ``theta_train`` back to the last good
        weights, a fresh optimizer (its moments belong to the abandoned trajectory)."""
        with self.lock:
            self.inf.load_state_dict(self.good)
            self.train.load_state_dict({k: v.float() for k, v in self.good.items()})
            self._new_optimizer()
            self.synced = self.version


class BackgroundTrainer:
    """Runs ``DrafterCopies.update`` jobs on one daemon thread, one at a time, so serving never
    waits for a backward. ``results`` receives ``(action, loss or None on failure)``."""

    def __init__(self, copies: DrafterCopies) -> None:
        self.copies = copies
        self.jobs: queue.Queue[tuple[Action, list[TrainExample]] | None] = queue.Queue()
        self.results: queue.Queue[tuple[Action, float | None]] = queue.Queue()
        self.device = copies.train.d2t.device
        # set once the thread has set its thread count and priority (or failed to)
        self.started = threading.Event()
        self.num_threads = 0  # the trainer thread's intra-op threads, once started (logged)
        self.thread = threading.Thread(target=self._run, name="specblock-adapt", daemon=True)
        caller_threads = torch.get_num_threads()  # fixes this thread's count (lazy init)
        self.thread.start()
        if self.device.type == "cpu":
            self.started.wait(STARTUP_TIMEOUT_S)
            torch.set_num_threads(caller_threads)  # the default again, not the trainer's 1

    def _cpu_thread_setup(self, device: torch.device) -> None:
        """CPU: one intra-op thread, niceness raised by ``trainer_nice`` (module docstring)."""
        if device.type != "cpu":
            return
        torch.set_num_threads(1)
        nice = self.copies.cfg.trainer_nice
        if nice <= 0 or not hasattr(os, "setpriority"):
            return
        try:
            tid = threading.get_native_id()
            current = os.getpriority(os.PRIO_PROCESS, tid)
            os.setpriority(os.PRIO_PROCESS, tid, min(current + nice, 19))
        except OSError as err:
            logger.warning("SPECBLOCK adapt: could not lower the trainer's priority: %s", err)

    def submit(self, action: Action, examples: list[TrainExample]) -> None:
        self.jobs.put((action, examples))

    def _run(self) -> None:
        device = self.device
        # On CUDA the update runs on its own stream (the paper's "train stream") and finishes
        # it before the version is published, so a sync on the serving stream reads final
        # weights; on CPU this is a plain thread sharing the cores.
        try:
            stream = torch.cuda.Stream(device) if device.type == "cuda" else None
            self._cpu_thread_setup(device)
            self.num_threads = torch.get_num_threads()  # also fixes it (lazy init)
            logger.info(
                "SPECBLOCK adapt: trainer thread on %s, %d intra-op thread(s), niceness %s",
                device,
                self.num_threads,
                os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
                if hasattr(os, "getpriority")
                else "n/a",
            )
        finally:
            self.started.set()
        while (job := self.jobs.get()) is not None:
            action, examples = job
            try:
                with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                    loss = self.copies.update(action, examples, stream)
                self.results.put((action, loss))
            except Exception:
                logger.exception(
                    "SPECBLOCK adapt: %s update failed; its steps discarded, drafting goes on"
                    " with the drafter in service",
                    action.value,
                )
                self.results.put((action, None))

    def close(self, timeout_s: float = 5.0) -> None:
        self.jobs.put(None)
        self.thread.join(timeout_s)
