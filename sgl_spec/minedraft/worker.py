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
footprint equals STANDALONE's on the same requests (``tests/test_minedraft_serving.py``).

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
(``feature_pool``), and each request's job carries the rows of the positions verified since its
last job, read through its ``req_to_token`` row: radix-cache hits and requests re-sent after a
draft-server restart find their rows there.
"""

from __future__ import annotations

import copy
import logging
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

from sgl_spec.argv import LaunchArgs
from sgl_spec.common.tree_verify import verify_trees
from sgl_spec.common.worker import TargetWrappingWorker
from sgl_spec.config import SpecConfig
from sgl_spec.minedraft.batch_manager import BatchManager, StepPlan
from sgl_spec.minedraft.client import DraftServerClient
from sgl_spec.minedraft.info import MineDraftDraftInput
from sgl_spec.minedraft.link import DraftJob, DraftLink
from sgl_spec.minedraft.messages import Hello
from sgl_spec.minedraft.settings import load_settings
from sgl_spec.minedraft.stats import MineDraftStats
from sgl_spec.verify.tree import DraftTree

logger = logging.getLogger(__name__)


@dataclass
class _Phase:
    rows: list[int]  # batch rows verified
    result: GenerationBatchResult


class MineDraftWorker(TargetWrappingWorker):
    """Wraps the target worker; the draft model runs in the draft-server process."""

    name = "MINEDRAFT"

    def __init__(self, server_args, gpu_id: int, nccl_port: int, target_worker) -> None:  # noqa: ANN001
        super().__init__(server_args, target_worker)
        self.settings = load_settings(
            SpecConfig.from_env(), LaunchArgs.from_server_args(server_args)
        )
        self.width = self.settings.width
        self.vocab_size = int(self.model_runner.model_config.vocab_size)
        self.manager = BatchManager(self.settings.policy)
        self.stats = MineDraftStats()
        self._drafts: dict[str, tuple[int, np.ndarray]] = {}  # rid -> (seq len, draft ids)
        # SpecBlock drafter: the target's features, one row per target KV location.
        self.feature_index = (
            self._capture_features() if self.settings.drafter == "specblock" else None
        )
        self._feature_pool: torch.Tensor | None = None
        self._step = 0  # draft requests sent (ids for the draft server)
        # Metrics line every --decode-log-interval phases (SGLang's decode log cadence).
        self.log_every = max(1, int(getattr(server_args, "decode_log_interval", 40) or 40))
        hello = Hello(
            draft_model_path=self.settings.draft_model_path,
            device=self.settings.device,
            num_steps=self.settings.num_steps,
            num_draft_tokens=self.width,
            topk=1,
            max_batch_size=self.settings.max_batch_size,
            seed=int(server_args.random_seed or 0),
            max_total_tokens=int(server_args.max_total_tokens or 0),
            drafter=self.settings.drafter,
        )
        # The draft server picks its cores from the affinity it inherits: the full set.
        affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        client = DraftServerClient(
            hello, f"{os.getpid()}-{uuid.uuid4().hex[:8]}", cpu_affinity=affinity
        )
        self.link = DraftLink(client, self.settings.draft_timeout_s)
        self._leave_draft_cores()
        self.link.start()
        logger.info(
            "MINEDRAFT: draft server pid %s on %s (%s %s), %d drafts per request, policy %s",
            client.pid,
            self.settings.device,
            self.settings.drafter,
            self.settings.draft_model_path,
            self.settings.num_steps,
            self.settings.policy,
        )
        self.set_verify_shape(self.settings.num_steps, self.width)

    def _capture_features(self) -> torch.Tensor:
        """Ask the target for the drafter's (low, mid, top) layer outputs, as SPECBLOCK does;
        returns the column index of the features in SGLang's captured hidden states."""
        from sgl_spec.specblock.settings import check_target_fit, read_drafter_config

        config = read_drafter_config(self.settings.draft_model_path)
        check_target_fit(
            config, self.model_runner.model_config.hf_config, self.settings.draft_model_path
        )
        return self.capture_layer_outputs(config.aux_layer_ids, config.target_hidden_size)

    @property
    def feature_pool(self) -> torch.Tensor:
        """``[locations, 3 * d_target]``: the features of the token at each target KV location,
        written when its KV is (prefill, verify). A request's rows are the locations of its
        ``req_to_token`` row, so radix-cache hits and re-sent requests find theirs; SGLang's KV
        budget counts these bytes (``patches/specblock_kv_budget.py``)."""
        if self._feature_pool is None:
            kv_pool = self.model_runner.token_to_kv_pool
            rows = int(kv_pool.size) + int(getattr(kv_pool, "page_size", 1)) + 1
            self._feature_pool = torch.zeros(
                rows, int(self.feature_index.numel()), dtype=self.model_runner.dtype,
                device=self.device,
            )  # fmt: skip
            logger.info(
                "MINEDRAFT: target feature cache %.1f MiB",
                self._feature_pool.numel() * self._feature_pool.element_size() / 2**20,
            )
        return self._feature_pool

    def _store_features(self, locs: torch.Tensor, hidden: torch.Tensor | None) -> None:
        """Features of the tokens whose KV was just written at ``locs`` (rows of ``hidden``)."""
        if hidden is None or locs.numel() == 0:
            return
        rows = hidden.index_select(-1, self.feature_index).to(self.feature_pool.dtype)
        self.feature_pool[locs.to(torch.long)] = rows

    def _feature_rows(self, req_pool_index: int) -> Callable[[int, int], np.ndarray]:
        """Rows of positions ``start .. end-1`` of a request, read when its job is sent."""
        req_to_token = self.model_runner.req_to_token_pool.req_to_token

        def rows(start: int, end: int) -> np.ndarray:
            locs = req_to_token[req_pool_index, start:end].to(torch.long)
            return self.feature_pool[locs].float().cpu().numpy()

        return rows

    def _leave_draft_cores(self) -> None:
        """``cpu:N``: the draft server takes the last N cores; the target keeps the others."""
        from sgl_spec.minedraft.draft_server import cpu_core_set, parse_device

        spec = parse_device(self.settings.device)
        if spec.kind != "cpu" or spec.index is None or not hasattr(os, "sched_setaffinity"):
            return
        available = sorted(os.sched_getaffinity(0))
        mine = sorted(set(available) - set(cpu_core_set(spec.index, available)))
        os.sched_setaffinity(0, mine)
        torch.set_num_threads(len(mine))
        logger.info("MINEDRAFT: target on cores %s", ",".join(map(str, mine)))

    # ---- entry point -------------------------------------------------------------------------

    def forward_prefill(self, batch) -> GenerationBatchResult:  # noqa: ANN001
        if self.feature_index is None:
            result = self._target_worker.forward_batch_generation(batch)
        else:
            result = self._target_worker.forward_batch_generation(
                batch, capture_hidden_mode=CaptureHiddenMode.FULL
            )
            hidden = result.logits_output.hidden_states
            result.logits_output.hidden_states = None
            self._store_features(batch.out_cache_loc, hidden)
        result.new_seq_lens = batch.seq_lens
        if isinstance(result.next_token_ids, torch.Tensor):
            result.next_draft_input = MineDraftDraftInput(
                bonus_tokens=result.next_token_ids.reshape(-1).to(torch.int64),
                new_seq_lens=batch.seq_lens,
            )
        return result

    # ---- decode: two phases ------------------------------------------------------------------

    def forward_decode(self, batch) -> GenerationBatchResult:  # noqa: ANN001
        rids = [req.rid for req in batch.reqs]
        self._sync_membership(rids)
        for rid in self.manager.rebalance():
            self._drafts.pop(rid, None)
        row_of = {rid: i for i, rid in enumerate(rids)}
        extra: dict[str, list[int]] = {}  # tokens verified earlier in this call
        phases: list[_Phase] = []
        plan = self.manager.plan_step()
        if plan.parallel and self.settings.overlap and self._can_split(batch):
            for _ in range(2):
                plan = self.manager.plan_step()
                draft_rows = [row_of[r] for r in plan.draft_rids]
                target_rows = [row_of[r] for r in plan.target_rids]
                phases.append(self._phase(batch, plan, target_rows, draft_rows, extra, True))
        else:  # standard SD on the whole batch (§5.2)
            rows = list(range(len(rids)))
            phases.append(self._phase(batch, plan, rows, rows, extra, False))
        return self._merge(batch, phases)

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

    @staticmethod
    def _can_split(batch) -> bool:  # noqa: ANN001
        """Rows whose outputs SGLang post-processes per batch position need one verify."""
        info = batch.sampling_info
        penalizer = getattr(info, "penalizer_orchestrator", None)
        return not (
            batch.return_logprob
            or batch.return_hidden_states
            or batch.has_grammar
            or (penalizer is not None and penalizer.is_required)
            or info.has_custom_logit_processor
            or any(getattr(info, "return_sampling_masks", None) or ())
        )

    def _phase(self, batch, plan: StepPlan, target_rows, draft_rows, extra, parallel: bool):  # noqa: ANN001, ANN202
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
        result = self._verify(batch, target_rows)
        verify_s = time.perf_counter() - verify_tic
        if submitted:
            sync_tic = time.perf_counter()
            draft_s += self._collect(self._step)
            wait_s = time.perf_counter() - sync_tic
        accept = result.accept_lens.tolist()
        tokens = result.next_token_ids.view(len(target_rows), self.width).tolist()
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
        self.manager.alternate(plan)
        if self.stats.phases % self.log_every == 0:
            logger.info(
                self.stats.summary(
                    self.link.num_faults,
                    self.link.num_restarts,
                    self.manager.balance,
                    self.manager.stats.num_moved,
                )
            )
        return _Phase(target_rows, result)

    def _fill(self, batch, target_rows, pool_indices, extra, plan: StepPlan) -> float:  # noqa: ANN001
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

    def _job(self, req, pool_index: int, extra: dict[str, list[int]]) -> DraftJob:  # noqa: ANN001
        tokens = [*req.origin_input_ids, *req.output_ids, *extra.get(req.rid, ())]
        features = None
        if self.feature_index is not None:
            features = self._feature_rows(int(pool_index))
        return DraftJob(req.rid, tokens, len(req.origin_input_ids), features)

    def _collect(self, step_id: int) -> float:
        got = self.link.collect(step_id)
        if got is None:
            return 0.0
        drafts, draft_s = got
        if self.link.check_output(drafts, self.vocab_size, self.settings.num_steps):
            self._drafts.update(drafts)
        return draft_s

    def _take_drafts(self, req) -> np.ndarray | None:  # noqa: ANN001
        """Drafts continuing exactly this request's current sequence, if any."""
        entry = self._drafts.get(req.rid)
        if entry is None:
            return None
        seq_len, ids = entry
        if seq_len != len(req.origin_input_ids) + len(req.output_ids):
            return None
        return ids

    # ---- verify ------------------------------------------------------------------------------

    def _verify(self, batch, rows: list[int]) -> GenerationBatchResult:  # noqa: ANN001
        sub = _sub_batch(batch, rows)
        seq_lens = sub.seq_lens.tolist()
        roots = batch.spec_info.bonus_tokens[rows].tolist()
        trees = []
        for row, root in zip(rows, roots, strict=True):
            tree = DraftTree.rooted_at(int(root))
            drafts = self._drafts.pop(batch.reqs[row].rid, None)
            if drafts is not None and drafts[0] == _seq_total(batch.reqs[row]):
                parent = 0
                for token in drafts[1].tolist():
                    parent = tree.add(int(token), parent, 0.0)
            trees.append(tree)
        result, _ = verify_trees(
            self,
            sub,
            trees,
            seq_lens,
            self.width,
            self.settings.num_steps,
            capture_hidden=self.feature_index is not None,
        )
        if self.feature_index is not None:
            # The accepted path (root + accepted drafts) is compacted to the front of each
            # request's rows and of its step slots; those tokens now have KV and features.
            hidden = result.logits_output.hidden_states
            result.logits_output.hidden_states = None
            req_to_token = self.model_runner.req_to_token_pool.req_to_token
            accept = result.accept_lens.tolist()
            pools = sub.req_pool_indices.tolist()
            for i, (n, pool_index) in enumerate(zip(accept, pools, strict=True)):
                if hidden is None:
                    break
                locs = req_to_token[pool_index, seq_lens[i] : seq_lens[i] + n]
                self._store_features(locs, hidden[i * self.width : i * self.width + n])
        return result

    def _merge(self, batch, phases: list[_Phase]) -> GenerationBatchResult:  # noqa: ANN001
        """One result in the batch's row order, as one verify of the whole batch returns it."""
        if len(phases) == 1 and phases[0].rows == list(range(len(batch.reqs))):
            result = phases[0].result
        else:
            bs, dev = len(batch.reqs), self.device
            first = phases[0].result
            ids = torch.zeros(bs, self.width, dtype=first.next_token_ids.dtype, device=dev)
            accept = torch.zeros(bs, dtype=first.accept_lens.dtype, device=dev)
            seq_lens = batch.seq_lens.clone()
            bonus = torch.zeros(bs, dtype=torch.int64, device=dev)
            for phase in phases:
                rows = torch.tensor(phase.rows, dtype=torch.long, device=dev)
                res = phase.result
                ids[rows] = res.next_token_ids.view(len(phase.rows), self.width)
                accept[rows] = res.accept_lens
                seq_lens[rows] = res.new_seq_lens.to(seq_lens.dtype)
                bonus[rows] = res.next_draft_input.bonus_tokens.to(torch.int64)
            result = GenerationBatchResult(
                logits_output=phases[-1].result.logits_output,
                next_token_ids=ids.reshape(-1),
                can_run_cuda_graph=False,
                speculative_num_draft_tokens=self.width,
                next_draft_input=MineDraftDraftInput(bonus_tokens=bonus, new_seq_lens=seq_lens),
                accept_lens=accept,
                new_seq_lens=seq_lens,
            )
            return result
        result.next_draft_input = MineDraftDraftInput(
            bonus_tokens=result.next_draft_input.bonus_tokens.to(torch.int64),
            new_seq_lens=result.new_seq_lens,
        )
        return result

    def close(self) -> None:
        self.link.close()


def _seq_total(req) -> int:  # noqa: ANN001
    return len(req.origin_input_ids) + len(req.output_ids)


def _sub_batch(batch, rows: list[int]):  # noqa: ANN001, ANN202
    """A copy of ``batch`` holding ``rows`` only; ``batch`` itself is left untouched (its
    sampling info is copied before SGLang's in-place filter; ``_can_split`` keeps rows with
    penalizer state, which that filter would mutate, out of split steps)."""
    sub = copy.copy(batch)
    sub.spec_info = None
    if len(rows) != len(batch.reqs):
        sub.sampling_info = copy.copy(batch.sampling_info)
        sub.sampling_info.penalizer_orchestrator = _NoPenalties()
        sub.filter_batch(keep_indices=rows)
    return sub


class _NoPenalties:
    """Stands in for the penalizer orchestrator in a split step (none is required there,
    ``_can_split``): SGLang's filter would otherwise mutate the shared one, or fail on None."""

    is_required = False

    def filter(self, keep_indices) -> None:  # noqa: ANN001
        return None
