"""``--standalone-steps auto|cycle|off``: STANDALONE_FULL's chain length chosen per step.

SGLang's EAGLE worker (v2) switches its number of draft steps at run time through
``AdaptiveController`` (``speculative/adaptive_runtime_state.py``): one runtime state per
candidate step count (attention backends and graphs sized for it), a policy that names the
step count of each decode batch, and a verify result fed back after each step. SGLang builds
that controller only for EAGLE/EAGLE3 with ``--speculative-adaptive`` (its own acceptance-only
policy); its STANDALONE worker leaves it unset. ``ControlledStandaloneWorker`` is SGLang's
``StandaloneWorkerV2`` with that controller built around ``StepsPolicy``, whose choice comes
from our speculation controller (``sgl_spec.control``: measured step times per batch size and
setting, running acceptance per position) -- or, for tests and measurement, a fixed cycle or
0. A step at 0 drafts is a plain decode step (``common/plain_step.py``, as ``none`` runs it,
not SGLang's 1-token verify), and the draft model defers its forwards meanwhile
(``catch_up.py``): such a step costs what ``none``'s step costs.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

from sglang.srt.speculative import standalone_worker_v2
from sglang.srt.speculative.adaptive_runtime_state import AdaptiveController, SpecRuntimeState

from sgl_spec.common.metrics import count_controller_failures
from sgl_spec.common.plain_step import plain_result, plain_step
from sgl_spec.control.chain_steps import ChainSteps
from sgl_spec.control.step_times import StepClock
from sgl_spec.standalone import catch_up


class StepsPolicy(ChainSteps):
    """SGLang's ``AdaptiveSpecPolicy`` for one STANDALONE_FULL worker: the step count of each
    decode batch, chosen before the step by ``choose`` (``ControlledStandaloneWorker``)."""

    def __init__(self, mode: str, max_steps: int) -> None:
        if mode not in ("auto", "cycle", "off"):
            raise ValueError(f"--standalone-steps {mode!r} has no policy")
        # The first drafted step after plain ones also runs the draft model over the tokens it
        # deferred (``catch_up.py``): a one-off cost of switching on that grows with the wait
        # before it, left out of that step's time (``ControlledStandaloneWorker``), so that
        # T(k) is what drafting costs per step however long it was off; the rest of that step
        # is timed like the steps after it (no ``steady_times``: no extra probe step).
        super().__init__(mode, max_steps, "--standalone-steps", steady_times=False)
        self._active = max_steps  # SGLang's active runtime state (the launch's at first)
        self._cuda_graph_bs: list[int] | None = None

    # -- SGLang's AdaptiveSpecPolicy --
    @property
    def candidate_steps(self) -> list[int]:
        """SGLang's runtime states: 0 drafts needs none (``ControlledStandaloneWorker`` runs
        a plain step instead of SGLang's 1-token verify); the launch's length is built first."""
        return [self.max_steps] if self.mode == "off" else list(range(1, self.max_steps + 1))

    def set_cuda_graph_bs(self, cuda_graph_bs: list[int] | None) -> None:
        self._cuda_graph_bs = cuda_graph_bs

    def cuda_graph_bs_for_step(self, step: int) -> list[int] | None:
        del step
        return self._cuda_graph_bs

    def get_steps_for_batch(self, batch_size: int) -> int:
        """The chosen length; after a plain step (0, no SGLang state) the one active before."""
        del batch_size
        if self.steps:
            self._active = self.steps
        return self._active

    def on_verify_complete(self, num_correct_drafts_per_req: list[int], batch_size: int) -> None:
        """Acceptance of the step that ran at ``self.steps``; the switch happens before the
        next step (``choose``), never here."""
        del batch_size
        self.observe(num_correct_drafts_per_req)


class ControlledStandaloneWorker(standalone_worker_v2.StandaloneWorkerV2):
    """SGLang's STANDALONE worker with an ``AdaptiveController`` over ``StepsPolicy`` (module
    docstring); everything else is SGLang's, the draft worker ours (``draft.py``)."""

    def __init__(self, server_args: Any, gpu_id: int, nccl_port: int, target_worker: Any) -> None:
        from sgl_spec.config import process_config

        super().__init__(server_args, gpu_id, nccl_port, target_worker)
        if not server_args.disable_overlap_schedule:  # the launcher turns it off
            raise ValueError("--standalone-steps other than fixed needs --disable-overlap-schedule")
        if self.topk != 1:
            raise ValueError(
                "--standalone-steps other than fixed needs a chain: --speculative-eagle-topk 1"
            )
        self.policy = StepsPolicy(process_config().standalone_steps, self.speculative_num_steps)
        metrics = getattr(self._draft_worker, "spec_metrics", None)
        count_controller_failures(self.policy.controller, metrics)
        self.adaptive_controller = AdaptiveController(self, self.policy)
        self._clock = StepClock()

    def build_adaptive_runtime_state(
        self,
        speculative_num_steps: int,
        speculative_num_draft_tokens: int,
        cuda_graph_bs: list[int] | None = None,
    ) -> SpecRuntimeState:
        """SGLang's, except where the target replays no decode graphs (the CPU engine): SGLang
        reads its graph config there, which still names a decode graph backend, and would
        capture verify graphs the CPU attention backend cannot; here each state gets its own
        attention backends (sized for its verify width) and no graphs."""
        target_runner = self._target_worker.model_runner
        if target_runner.decode_cuda_graph_runner is not None:
            return super().build_adaptive_runtime_state(
                speculative_num_steps, speculative_num_draft_tokens, cuda_graph_bs
            )
        draft = self._draft_worker
        with self._override_worker_state(speculative_num_steps, speculative_num_draft_tokens):
            draft.init_attention_backend()
            backup = target_runner.init_new_workspace
            try:
                target_attn_backend = target_runner._get_attention_backend(init_new_workspace=True)
            finally:
                target_runner.init_new_workspace = backup
            return SpecRuntimeState(
                speculative_num_steps=speculative_num_steps,
                speculative_num_draft_tokens=speculative_num_draft_tokens,
                draft_attn_backend=draft.draft_attn_backend,
                cuda_graph_runner=None,
                target_attn_backend=target_attn_backend,
                target_graph_runner=None,
                draft_extend_attn_backend=draft.draft_extend_attn_backend,
                cuda_graph_runner_for_draft_extend=None,
            )

    def forward_batch_generation(self, batch: Any, *args: Any, **kwargs: Any) -> Any:
        decode = not (batch.forward_mode.is_extend() or batch.is_extend_in_batch)
        if decode and not batch.forward_mode.is_idle() and batch.reqs:
            if self._choose(batch) == 0:
                return self._plain_step(batch)
        tic = time.perf_counter()
        result = super().forward_batch_generation(batch, *args, **kwargs)
        controller = self.policy.controller
        if not decode and controller is not None:
            # a prefill between two decode steps: the same work whatever length the steps ran
            # (each request is prefilled once), so it is left out of the step it follows,
            # which is timed up to the next decode step (``time_batch_changes``)
            self._clock.exclude(time.perf_counter() - tic)
        if decode and controller is not None and self._draft_worker.catch_up_s > 0:
            # the draft reading what it deferred while off is the switch's cost, not a cost
            # of every step at this length (it grows with the wait before it)
            self._clock.exclude(self._draft_worker.catch_up_s)
            controller.prices.switched(self._draft_worker.catch_up_s)
        return result

    def _plain_step(self, batch: Any) -> Any:
        """A step without drafts, as a non-speculative server runs it (``common/plain_step``:
        SGLang's DECODE forward of each bonus token, the next token sampled as plain decoding
        samples it), in place of SGLang's 1-token verify; the draft defers its forwards."""
        tic = time.perf_counter()
        draft = self._draft_worker
        bonus = batch.spec_info.bonus_tokens
        worker = SimpleNamespace(
            model_runner=self._target_worker.model_runner, _target_worker=self._target_worker
        )
        # eager: the target's decode graphs, where captured, are the active state's verify
        # graphs (steps + 1 tokens per request), not graphs of a one-token decode
        graphs = self._target_worker.model_runner.decode_cuda_graph_runner
        self._target_worker.model_runner.decode_cuda_graph_runner = None
        try:
            step = plain_step(worker, batch, bonus)
        finally:
            self._target_worker.model_runner.decode_cuda_graph_runner = graphs
        verify_s = time.perf_counter() - tic
        catch_up.defer(batch.reqs, bonus)
        next_draft_input = draft.placeholder_input(step.tokens)
        next_draft_input.cuda_graph_compatible = True  # as after SGLang's draft extend
        if catch_up.over_limit(batch.reqs):
            draft._catch_up(batch, batch.seq_lens + 1, step.tokens, next_draft_input)
        metrics = draft.spec_metrics
        if metrics is not None:
            bs = len(batch.reqs)
            metrics.observe_step([0] * bs, [0] * bs, time.perf_counter() - tic - verify_s, verify_s)
        return plain_result(batch, step, next_draft_input)

    def _choose(self, batch: Any) -> int:
        """Before a decode step: the controller learns what the previous one cost (the
        scheduler's work on its output included) and picks this one's step count, which
        SGLang's ``activate_step_by_batch`` applies."""
        now = time.perf_counter()
        rids = tuple(req.rid for req in batch.reqs)
        if self.policy.controller is not None:  # auto (cycle and off learn nothing)
            self._clock.start(rids, now, self.policy.controller)
        seq_lens = batch.seq_lens_cpu if batch.seq_lens_cpu is not None else batch.seq_lens.cpu()
        ctx = int(seq_lens.max()) if len(rids) else 0
        steps = self.policy.choose(len(rids), ctx)
        self._clock.chosen(steps, len(rids))
        return steps

    def on_verify_complete_cpu(
        self, num_correct_drafts_per_req: list[int], batch_size: int = 0
    ) -> None:
        steps = self.policy.steps  # a plain step leaves SGLang's runtime state as it was
        super().on_verify_complete_cpu(num_correct_drafts_per_req, batch_size)
        metrics = self._draft_worker.spec_metrics
        if metrics is None or not num_correct_drafts_per_req:
            return
        metrics.observe_k(steps)
        if self.policy.controller is not None:
            realised = 1 + sum(num_correct_drafts_per_req) / len(num_correct_drafts_per_req)
            metrics.observe_prediction(self.policy.lam, realised)
