"""MINEDRAFT worker: batch-parallel speculative decoding inside SGLang's scheduler (paper §5.2).

The running requests are split into two batches by the ``BatchManager`` (§5.1, with the
Appendix A load-balancing fix). One call of SGLang's decode step runs two MineDraft SD steps
(*phases*), so every running request is verified exactly once per call and SGLang's own
scheduling, KV reservation and output processing stay as they are:

    phase 1: submit batch B to the draft server | target verifies batch A | sync (B's drafts)
    phase 2: submit batch A (with phase 1's tokens) | target verifies batch B | sync (A's drafts)

The drafts collected at each sync point are verified one phase later: B's in phase 2, A's in
phase 1 of the next call. The target never holds KV for a batch it is not verifying (§5.3):
each request's verify slots are SGLang's ordinary one-verify-per-step reservation, so the KV
footprint equals STANDALONE's on the same requests (``tests/e2e/test_minedraft_serving.py``).

Fallback (§5.2): with one batch empty (or ``--minedraft-overlap off``), or with requests whose
outputs SGLang post-processes per batch row (logprobs, penalties, hidden states, custom logit
processors, grammars, sampling masks), the call is one standard SD step: draft everything, then
verify everything. Without a draft server (crashed, hung, restarting: ``link.py``) requests are
verified without drafts, i.e. decoded target-only, and stay lossless. Verification is SGLang's
tree verify on chain trees: greedy takes the longest matching prefix, sampling is target-only
rejection sampling, whose output law is the target's whatever the drafts (greedy drafts are
sent).

With ``--minedraft-drafter specblock`` the draft server hosts a SpecBlock drafter
(``specblock_host.py``), which conditions on the target's (low, mid, top) features: prefill and
verify capture them as SPECBLOCK does into a cache with one row per target KV location
(``feature_cache.py``), and each request's job carries the rows of the positions verified since
its last job, read through its ``req_to_token`` row: radix-cache hits and requests re-sent after
a draft-server restart find their rows there.

With ``--tp-size N`` every tensor rank runs this worker on its shard and the same plan; rank 0
alone talks to the replica's draft server and every rank verifies the drafts it shares
(``rank_link.py``); the drafts per request, when the controller chooses them, are rank 0's too
(``control/ranks.py``). With ``--dp-size N`` each replica has its own worker and draft server.

This module is the worker and its two-phase step. Starting the draft server (and splitting the
cores with a ``cpu:N`` one) is ``draft_launch.py``; how a batch is split into phases and their
results merged back is ``phases.py``.
"""

from __future__ import annotations

import logging
import os
import time

import numpy as np
import torch
from sglang.srt.managers.utils import GenerationBatchResult

from sgl_spec.common import compiled_forwards
from sgl_spec.common.metrics import count_controller_failures
from sgl_spec.common.plain_step import plain_result, plain_step
from sgl_spec.common.tree_verify import verify_trees
from sgl_spec.common.worker import TargetWrappingWorker
from sgl_spec.control.chain_steps import ChainSteps, chain_widths
from sgl_spec.minedraft.batch_manager import BatchManager, StepPlan
from sgl_spec.minedraft.draft_launch import start_ranked_link
from sgl_spec.minedraft.feature_cache import TargetFeatureCache
from sgl_spec.minedraft.info import MineDraftDraftInput
from sgl_spec.minedraft.link import DraftJob
from sgl_spec.minedraft.phases import Phase, can_split, merge_phases, sub_batch
from sgl_spec.minedraft.settings import MineDraftSettings
from sgl_spec.minedraft.stats import MineDraftStats
from sgl_spec.verify.tree import DraftTree

logger = logging.getLogger(__name__)
# During plain steps a request's tokens go to the draft server once it lags this many
# (``_catch_up``); the environment variable sets another number, 0 none (for measuring).
CATCH_UP_ENV = "SGLSPEC_MINEDRAFT_CATCH_UP_TOKENS"
CATCH_UP_TOKENS = 16
# ... only within this many plain steps of the next drafted one (a probe): the draft server's
# work competes with the target's for the host, so it runs only where a probe will use it.
CATCH_UP_AHEAD = 4


class MineDraftWorker(TargetWrappingWorker):
    """Wraps the target worker; the draft model runs in the draft-server process."""

    name = "MINEDRAFT"

    def __init__(
        self, server_args, gpu_id: int, nccl_port: int, target_worker, settings: MineDraftSettings
    ) -> None:
        super().__init__(server_args, target_worker)
        self.settings = settings
        self.width = self.settings.width
        self.vocab_size = int(self.model_runner.model_config.vocab_size)
        self.manager = BatchManager(self.settings.policy)
        self.stats = MineDraftStats()
        self._drafts: dict[str, tuple[int, np.ndarray]] = {}  # rid -> (seq len, draft ids)
        # SpecBlock drafter: the target's features, one row per target KV location.
        self.features = (
            TargetFeatureCache(self.model_runner, self._capture_features(), self.device)
            if self.settings.drafter == "specblock"
            else None
        )
        self._step = 0  # draft requests sent (ids for the draft server)
        # Metrics line every --decode-log-interval phases (SGLang's decode log cadence).
        self.log_every = max(1, int(getattr(server_args, "decode_log_interval", 40) or 40))
        # rank 0's draft server, its drafts shared with every tensor rank (rank_link.py)
        self.link = start_ranked_link(self.settings, server_args, self.vocab_size)
        self.link.on_restart(self.metrics.set_restarts)
        self.set_verify_shape(self.settings.num_steps, self.width)
        # drafts verified per request each step (--minedraft-steps); the controller, if auto
        self.steps = ChainSteps(settings.steps_mode, settings.num_steps, "--minedraft-steps")
        self.controller = self.steps.controller
        count_controller_failures(self.controller, self.metrics)
        self.catch_up_tokens = catch_up_tokens()
        self.k = settings.num_steps  # this step's drafts per request (its width is k + 1)

    def compiled_shapes(self, batch_sizes: list[int]) -> list[compiled_forwards.Shape]:
        """The verify of each width the step policy may pick (chains of one width per
        sub-batch, verified as trees), and the plain decode where it may draft nothing."""
        widths, decode = chain_widths(self.steps.mode, self.steps.max_steps)
        return compiled_forwards.forward_shapes(batch_sizes, widths, decode, tree=True)

    def _capture_features(self) -> torch.Tensor:
        """Ask the target for the drafter's (low, mid, top) layer outputs, as SPECBLOCK does;
        returns the column index of the features in SGLang's captured hidden states."""
        from sgl_spec.specblock.settings import check_target_fit

        config = self.settings.drafter_config
        check_target_fit(
            config, self.model_runner.model_config.hf_config, self.settings.draft_model_path
        )
        return self.capture_layer_outputs(config.aux_layer_ids, config.target_hidden_size)

    # ---- entry point -------------------------------------------------------------------------

    def forward_prefill(self, batch) -> GenerationBatchResult:
        result = self.prefill_target(
            batch, MineDraftDraftInput.carried, capture_hidden=self.features is not None
        )
        if self.features is not None:  # the SpecBlock drafter's features of every new position
            hidden = result.logits_output.hidden_states
            result.logits_output.hidden_states = None
            self.features.store(batch.out_cache_loc, hidden)
        return result

    # ---- decode: two phases ------------------------------------------------------------------

    def forward_decode(self, batch) -> GenerationBatchResult:
        tic = time.perf_counter()
        self.step_started(batch, tic)
        rids = [req.rid for req in batch.reqs]
        self._sync_membership(rids)
        for rid in self.manager.rebalance():
            self._drafts.pop(rid, None)
        self.k = self._choose(batch)
        if self.k == 0:
            return self._forward_plain(batch, tic)
        row_of = {rid: i for i, rid in enumerate(rids)}
        extra: dict[str, list[int]] = {}  # tokens verified earlier in this call
        phases: list[Phase] = []
        plan = self.manager.plan_step()
        if plan.parallel and self.settings.overlap and can_split(batch):
            for _ in range(2):
                plan = self.manager.plan_step()
                draft_rows = [row_of[r] for r in plan.draft_rids]
                target_rows = [row_of[r] for r in plan.target_rids]
                phases.append(self._phase(batch, plan, target_rows, draft_rows, extra, True))
        else:  # standard SD on the whole batch (§5.2)
            rows = list(range(len(rids)))
            phases.append(self._phase(batch, plan, rows, rows, extra, False))
        result = merge_phases(batch, phases, self.k + 1, self.device)
        if self.controller is not None:
            realised = sum(len(tokens) for tokens in extra.values()) / len(rids)
            self.metrics.observe_prediction(self.steps.lam, realised)
        return result

    def _choose(self, batch) -> int:
        """This step's drafts per request (``--minedraft-steps``)."""
        if self.steps.mode == "fixed":
            return self.settings.num_steps
        seq_lens = batch.seq_lens_cpu if batch.seq_lens_cpu is not None else batch.seq_lens.cpu()
        k = self.steps.choose(len(batch.reqs), int(seq_lens.max()))
        self.step_chosen(k, len(batch.reqs))
        self.metrics.observe_k(k)
        return k

    def _forward_plain(self, batch, tic: float) -> GenerationBatchResult:
        """No drafts: the plain decode step of the whole batch (``common/plain_step.py``);
        nothing goes to the draft server, whose next job for each request carries the tokens
        committed meanwhile (a job sends the sequence past what the server has)."""
        bonus = batch.spec_info.bonus_tokens
        step = plain_step(self, batch, bonus, capture_hidden=self.features is not None)
        if self.features is not None:  # the bonus tokens' features, at their KV slots
            req_to_token = self.model_runner.req_to_token_pool.req_to_token
            locs = req_to_token[batch.req_pool_indices.to(torch.int64), batch.seq_lens.long()]
            self.features.store(locs, step.hidden)
        if self.catch_up_tokens and self.steps.steps_to_probe() <= CATCH_UP_AHEAD:
            self._catch_up(batch)  # after the features of the tokens it sends are stored
        seconds = time.perf_counter() - tic
        bs = len(batch.reqs)
        self.stats.record_phase(
            parallel=False, num_verified=bs, num_accepted=0, num_undrafted=bs,
            verify_s=seconds, draft_s=0.0, wait_s=0.0,
        )  # fmt: skip
        self.metrics.observe_step([0] * bs, [0] * bs, 0.0, seconds)
        carried = MineDraftDraftInput.carried(step.tokens, batch.seq_lens + 1)
        return plain_result(batch, step, carried)

    def _catch_up(self, batch) -> None:
        """Plain steps leave the draft server idle and behind: a few steps before the next
        drafted one, send it, unawaited, the tokens of each request it lags ``catch_up_tokens``
        or more (a new one's prompt), so that it extends its cache on its own device while the
        target decodes, and that step only appends what the last few steps committed."""
        lagging = [
            i
            for i, req in enumerate(batch.reqs)
            if self.link.lag(req.rid, _seq_total(req)) >= self.catch_up_tokens
        ]
        self._step += 1  # step ids count only on rank 0, which holds the server's link
        if lagging:
            pool_indices = batch.req_pool_indices.tolist()
            jobs = [self._job(batch.reqs[i], pool_indices[i], {}) for i in lagging]
            self.link.catch_up(self._step, jobs)

    def _sync_membership(self, rids: list[str]) -> None:
        """Recycle the requests that left since the last call, assign the new ones (§5.1)."""
        current = set(rids)
        gone = [rid for rid in self.manager.running() if rid not in current]
        for rid in gone:
            self.manager.recycle(rid)
            self._drafts.pop(rid, None)
        self.link.removed(gone)
        for rid in rids:
            if rid not in self.manager:
                self.manager.assign(rid)

    def _phase(self, batch, plan: StepPlan, target_rows, draft_rows, extra, parallel: bool):
        """One SD step: submit ``draft_rows`` to the draft server, verify ``target_rows``, sync.
        In a fallback step both are the whole batch and the drafts are awaited first."""
        tic = time.perf_counter()
        pool_indices = batch.req_pool_indices.tolist()
        fill_s = self._fill(batch, target_rows, pool_indices, extra, plan) if parallel else 0.0
        self._step += 1
        jobs = [self._job(batch.reqs[i], pool_indices[i], extra) for i in draft_rows]
        submitted = bool(jobs) and self.link.submit(self._step, plan.skip_batch, jobs)
        wait_s, draft_s = 0.0, fill_s
        if not parallel and submitted:
            draft_s = self._collect(self._step)
            submitted = False
        verify_tic = time.perf_counter()
        num_undrafted = sum(1 for i in target_rows if self._take_drafts(batch.reqs[i]) is None)
        result, num_offered = self._verify(batch, target_rows)
        verify_s = time.perf_counter() - verify_tic
        if submitted:
            sync_tic = time.perf_counter()
            draft_s += self._collect(self._step)
            wait_s = time.perf_counter() - sync_tic
        accept = result.accept_lens.tolist()
        tokens = result.next_token_ids.view(len(target_rows), self.k + 1).tolist()
        for i, row in enumerate(target_rows):
            extra.setdefault(batch.reqs[row].rid, []).extend(tokens[i][: accept[i]])
        self.stats.record_phase(
            parallel=parallel,
            num_verified=len(target_rows),
            num_accepted=sum(accept) - len(accept),
            num_undrafted=num_undrafted,
            verify_s=verify_s if parallel else time.perf_counter() - tic,
            draft_s=draft_s,
            wait_s=wait_s,
        )
        self.metrics.observe_step([a - 1 for a in accept], num_offered, draft_s, verify_s)
        self.steps.observe([a - 1 for a, n in zip(accept, num_offered, strict=True) if n == self.k])
        self.metrics.observe_phase(self.stats.overlap_bound, len(target_rows), len(draft_rows))
        self.manager.alternate(plan)
        if self.stats.phases % self.log_every == 0:
            logger.info(
                self.stats.summary(
                    self.link.num_faults,
                    self.link.num_restarts,
                    self.manager.balance,
                    self.manager.stats.num_moved,
                    self.link.num_catch_ups,
                )
            )
        return Phase(target_rows, result)

    def _fill(self, batch, target_rows, pool_indices, extra, plan: StepPlan) -> float:
        """Start-up step (§5.2) for the target rows that have no drafts yet (requests new since
        the last call): draft them and wait, so that no request's first verify runs undrafted
        (one token for a whole verify). Returns the drafting time."""
        missing = [i for i in target_rows if self._take_drafts(batch.reqs[i]) is None]
        if not missing:
            return 0.0
        fill = [self._job(batch.reqs[i], pool_indices[i], extra) for i in missing]
        self._step += 1
        if not self.link.submit(self._step, plan.target_batch, fill):
            return 0.0
        return self._collect(self._step)

    def _job(self, req, pool_index: int, extra: dict[str, list[int]]) -> DraftJob:
        tokens = [*req.origin_input_ids, *req.output_ids, *extra.get(req.rid, ())]
        features = None if self.features is None else self.features.rows(int(pool_index))
        return DraftJob(req.rid, tokens, len(req.origin_input_ids), features)

    def _collect(self, step_id: int) -> float:
        got = self.link.collect(step_id)
        if got is None:
            return 0.0
        drafts, draft_s = got
        self._drafts.update(drafts)
        return draft_s

    def _take_drafts(self, req) -> np.ndarray | None:
        """Drafts continuing exactly this request's current sequence, if any."""
        entry = self._drafts.get(req.rid)
        if entry is None:
            return None
        seq_len, ids = entry
        if seq_len != len(req.origin_input_ids) + len(req.output_ids):
            return None
        return ids

    # ---- verify ------------------------------------------------------------------------------

    def _verify(self, batch, rows: list[int]) -> tuple[GenerationBatchResult, list[int]]:
        """Verify ``rows`` with their drafts; returns SGLang's result and each row's number of
        drafts verified."""
        sub = sub_batch(batch, rows)
        seq_lens = sub.seq_lens.tolist()
        roots = batch.spec_info.bonus_tokens[rows].tolist()
        trees = []
        for row, root in zip(rows, roots, strict=True):
            drafts = self._drafts.pop(batch.reqs[row].rid, None)
            fresh = drafts is not None and drafts[0] == _seq_total(batch.reqs[row])
            chain = drafts[1][: self.k].tolist() if fresh else ()
            trees.append(DraftTree.chain(int(root), chain))
        width = self.k + 1
        result, _ = verify_trees(
            self, sub, trees, seq_lens, width, self.k, capture_hidden=self.features is not None
        )
        if self.features is not None:
            hidden = result.logits_output.hidden_states
            result.logits_output.hidden_states = None
            self.features.store_accepted(
                hidden,
                sub.req_pool_indices.tolist(),
                seq_lens,
                result.accept_lens.tolist(),
                width,
            )
        return result, [min(tree.num_nodes - 1, self.k) for tree in trees]

    def close(self) -> None:
        self.link.close()


def catch_up_tokens() -> int:
    """``CATCH_UP_TOKENS``, or the environment's number (``CATCH_UP_ENV``, >= 0)."""
    text = os.environ.get(CATCH_UP_ENV, str(CATCH_UP_TOKENS))
    if not text.strip().isdigit():
        raise ValueError(f"{CATCH_UP_ENV} must be a whole number >= 0 (0: off), got {text!r}")
    return int(text)


def _seq_total(req) -> int:
    return len(req.origin_input_ids) + len(req.output_ids)
