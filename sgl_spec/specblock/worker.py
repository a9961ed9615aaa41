"""SPECBLOCK worker: SGLang glue around the pure drafting, packing and verification pieces.

Per decode step (paper Algorithm 2): grow every request's tree with up to M batched drafter
forwards (``drafting.grow_trees``), pack the trees into one TARGET_VERIFY batch with their
ancestor masks (``packing``), verify them in one target forward with SGLang's own tree verify
(``run_eagle_verify``: greedy longest matching path, or multi-candidate rejection sampling over
siblings -- on CPU hosts our PyTorch sampler, ``sgl_spec/patches/cpu_spec_sampling``), which
also moves the accepted path's KV to the front of the step's slots; the rest of the slots stay
in the step's reservation and are overwritten by later steps. Then one drafter *extend* forward
over the accepted tokens, on the target features the verify forward captured, fills the
drafter's KV cache (``draft_kv``) and yields the next tree's condition (``follow``).

The node budget of a step is fixed (``--specblock-max-nodes``) or chosen per step by the
speculation controller (``--specblock-budget auto``, ``sgl_spec/control``). A budget of 1
verifies the root alone without drafting; the drafter reads that step's token later, with the
next drafting step's (``pending``).

Prefill is SGLang's target extend with the (low, mid, top) features captured as for EAGLE-3,
followed by the drafter extend over the prompt. A drafting failure degrades to verifying the
root alone (plain decoding) and is logged.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import torch
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

from sgl_spec.common import compiled_forwards
from sgl_spec.common.metrics import count_controller_failures
from sgl_spec.common.plain_step import plain_result, plain_step
from sgl_spec.common.tree_verify import verify_trees
from sgl_spec.common.worker import TargetWrappingWorker
from sgl_spec.control.budget import budget_controller
from sgl_spec.control.guard import served_controller
from sgl_spec.control.ranks import RankZeroDecides, flag_agreed_across_ranks
from sgl_spec.patches.cpu_packed_linear import pack_linear_modules
from sgl_spec.specblock.adapt.serving import OnlineAdapter, request_keys
from sgl_spec.specblock.config import CheckpointError
from sgl_spec.specblock.draft_kv import DrafterKVPool
from sgl_spec.specblock.drafting import (
    DraftResult,
    DraftSettings,
    PrefixContext,
    grow_trees,
)
from sgl_spec.specblock.follow import DrafterFollowing
from sgl_spec.specblock.info import SpecBlockDraftInput
from sgl_spec.specblock.model import SpecBlockDrafter
from sgl_spec.specblock.ngram_branch import NgramBranch
from sgl_spec.specblock.settings import SpecBlockSettings, check_target_fit, drafter_dtype
from sgl_spec.specblock.stats import SpecBlockStats, offered_depth
from sgl_spec.specblock.tree import observed_budgets
from sgl_spec.verify.packing import accepted_path
from sgl_spec.verify.tree import DraftTree

logger = logging.getLogger(__name__)
LOG_EVERY_STEPS = 50


class SpecBlockWorker(DrafterFollowing, TargetWrappingWorker):
    """Wraps the target worker; the drafter and its KV pool live here."""

    name = "SPECBLOCK"

    def __init__(
        self, server_args, gpu_id: int, nccl_port: int, target_worker, settings: SpecBlockSettings
    ) -> None:
        super().__init__(server_args, target_worker)
        self.settings = settings
        self.draft_settings = settings.draft
        self.block_size = settings.block_size
        self.drafter_dtype = drafter_dtype(settings.drafter_dtype, self.model_runner.dtype)
        self.drafter = self._load_drafter(settings.drafter_path)
        cfg = self.drafter.config
        self.feature_index = self.capture_layer_outputs(cfg.aux_layer_ids, cfg.target_hidden_size)
        self._pool: DrafterKVPool | None = None  # allocated once SGLang's KV pool exists
        self._rows = None  # the unread tokens' rows (target_rows.py), with steps without drafts
        logger.info(
            "SPECBLOCK: drafter %s (K=%d, using %d, M=%d, branching %s, rank head %s,"
            " max nodes %d, %s)",
            settings.drafter_path,
            cfg.block_size,
            self.block_size,
            self.draft_settings.num_blocks,
            self.draft_settings.bucket_map,
            "on" if self.draft_settings.use_rank_head else "off",
            self.draft_settings.max_nodes,
            str(self.drafter_dtype).removeprefix("torch."),
        )
        self.stats = SpecBlockStats(settings.max_depth)
        self.adapter = (
            None if settings.adapt is None else OnlineAdapter(self.drafter, settings.adapt)
        )
        if self.adapter is not None:
            logger.info("SPECBLOCK: cost-aware adaptation on: %s", settings.adapt)
        agree = flag_agreed_across_ranks()  # the n-gram choice, rank 0's on every rank
        self.ngram = NgramBranch(settings.ngram, agree=agree) if settings.ngram else None
        self._alone = False  # the last decode step verified the n-gram trees alone
        self.set_verify_shape(settings.verify_depth, self.draft_settings.max_nodes)
        # --specblock-budget auto / cycle: setting k verifies budgets[k] nodes
        varied = settings.budget in ("auto", "cycle")
        self.budgets = settings.step_budgets()
        self._last_budget = self.budgets[0]  # of the last decode step (a fresh server's: plain)
        self._last_batch_size = 0  # requests in the last decode step
        self._budget_settings = [replace(settings.draft, max_nodes=n) for n in self.budgets]
        # nodes and depth of a step that verifies the n-gram trees alone: the largest budget
        self._alone_shape = (self.budgets[-1], min(settings.verify_depth, self.budgets[-1] - 1))
        self.controller = served_controller(
            budget_controller(self.budgets, settings.budget_drafts())
            if settings.budget == "auto"
            else None
        )
        count_controller_failures(self.controller, self.metrics)
        self._num_steps = 0
        self._decision = None  # the controller's last Decision
        if varied:
            logger.info(
                "SPECBLOCK: node budget per step (%s) among %s", settings.budget, self.budgets
            )

    # ---- set-up ------------------------------------------------------------------------------

    def compiled_shapes(self, batch_sizes: list[int]) -> list[compiled_forwards.Shape]:
        """Each node budget's tree verify, and the plain decode of a budget of 1."""
        return compiled_forwards.forward_shapes(
            batch_sizes, self.budgets, decode=1 in self.budgets, tree=True
        )

    def _load_drafter(self, path: str) -> SpecBlockDrafter:
        try:
            drafter = SpecBlockDrafter.from_pretrained(path)
        except CheckpointError as exc:
            raise ValueError(f"--specblock-drafter-path: {exc}") from exc
        check_target_fit(drafter.config, self.model_runner.model_config.hf_config, path)
        drafter = drafter.to(device=self.device, dtype=self.drafter_dtype).eval()
        pack_linear_modules(drafter)  # float32 on the CPU: the target's packed kernel
        return drafter

    def clear_cache_pool(self) -> None:
        """``/flush_cache``: the n-gram corpus goes with the prefix cache."""
        super().clear_cache_pool()
        if self.ngram is not None:
            self.ngram.reset()

    # ---- prefill -----------------------------------------------------------------------------

    def forward_prefill(self, batch) -> GenerationBatchResult:
        result = self._target_worker.forward_batch_generation(
            batch, capture_hidden_mode=CaptureHiddenMode.FULL
        )
        result.new_seq_lens = batch.seq_lens
        hidden = result.logits_output.hidden_states
        result.logits_output.hidden_states = None
        extend_lens = torch.tensor(batch.extend_lens, dtype=torch.long, device=self.device)
        prefix_lens = torch.tensor(batch.prefix_lens, dtype=torch.long, device=self.device)
        reqs = batch.req_pool_indices.to(torch.long)
        tokens = batch.input_ids.to(torch.long)
        if self.settings.runs_plain_steps:
            root_cond, pending = self._prefill_rows(reqs, prefix_lens, extend_lens, hidden, tokens)
        else:
            starts = torch.cumsum(extend_lens, 0) - extend_lens
            root_cond = self._drafter_extend(reqs, prefix_lens, extend_lens, hidden, tokens, starts)
            pending = torch.zeros_like(extend_lens)
        if isinstance(result.next_token_ids, torch.Tensor):
            bonus = result.next_token_ids.reshape(-1).to(torch.int64)
            result.next_draft_input = SpecBlockDraftInput(
                bonus_tokens=bonus,
                root_cond=root_cond,
                new_seq_lens=batch.seq_lens,
                pending_count=pending,
            )
        return result

    def _prefill_rows(self, reqs, prefix_lens, extend_lens, hidden, tokens):
        """With steps without drafts: the prompt's rows are kept (``target_rows``), and the
        drafter reads them -- with any prefix a radix-cache hit found unread -- now if the last
        decode step drafted, else before the first step that drafts for this request (never,
        if none does). Returns the root condition and the unread count per request."""
        self._store_committed(reqs, prefix_lens, extend_lens, self._features(hidden), tokens)
        req_to_token = self.model_runner.req_to_token_pool.req_to_token
        seq_lens = prefix_lens + extend_lens
        pending = self._rows.unread_tail(req_to_token, reqs, seq_lens)
        root_cond = torch.zeros(
            reqs.shape[0], self.drafter.config.hidden_size, dtype=self.drafter_dtype,
            device=self.device,
        )  # fmt: skip
        if not self._drafts_next(reqs.shape[0], seq_lens):
            return root_cond, pending
        return self._catch_up(reqs, seq_lens, pending, root_cond), torch.zeros_like(pending)

    def _drafts_next(self, num_new: int, seq_lens: torch.Tensor) -> bool:
        """Whether the decode step after a prefill of ``num_new`` requests is expected to draft:
        the last one did, and the controller (where it decides alone, not for tensor-parallel
        ranks) would at the batch they join, not while it measures that batch's plain step.
        Else the prompts stay unread until a step drafts for them (bench_serving's warm-up
        request drafts; the wave after it need not)."""
        if self._last_budget == 1:
            return False
        if self.controller is None or isinstance(self.controller, RankZeroDecides):
            return True
        batch_size = max(num_new, self._last_batch_size)
        ctx = int(seq_lens.sum()) // max(num_new, 1)
        return self.controller.expects_drafts(batch_size, ctx)

    # ---- decode step -------------------------------------------------------------------------

    def forward_decode(self, batch) -> GenerationBatchResult:
        tic = time.perf_counter()
        if self.adapter is not None:
            try:  # step boundary: trained drafter weights may enter theta_inf here
                self.adapter.before_draft()
            except Exception:
                logger.exception("SPECBLOCK adapt: weight sync failed; drafting unchanged")
        state: SpecBlockDraftInput = batch.spec_info
        reqs = batch.req_pool_indices.to(torch.long)
        seq_lens = batch.seq_lens.to(torch.long)
        seq_lens_list = seq_lens.tolist()
        roots = state.bonus_tokens.to(torch.long).tolist()
        self.step_started(batch, tic)
        self._alone = self._plan_alone(batch.reqs, seq_lens_list)
        if self._alone:  # no step of the controller's settings: it does not decide one
            k, (width, depth) = len(self.budgets) - 1, self._alone_shape
            self._last_batch_size = len(roots)
            self.step_chosen(-1, len(roots))
        else:
            k = self._choose_budget(seq_lens_list)
            if self.budgets[k] == 1:  # no drafts: a plain decode step (the drafter reads later)
                return self._forward_plain(batch, state, tic, k)
            width = self.budgets[k]
            depth = min(self.settings.verify_depth, width - 1)  # no deeper than `width` allows
        settings = self._budget_settings[k]
        run_drafter = lambda: self._catch_up_and_draft(reqs, seq_lens, state, roots, settings)  # noqa: E731
        if self.ngram is None:
            drafted, context = run_drafter()
        else:
            drafted, context = self.ngram.draft(roots, width, depth, run_drafter)
        draft_s = time.perf_counter() - tic
        result, packed = verify_trees(
            self, batch, drafted.trees, seq_lens_list, width, depth, capture_hidden=True
        )
        accept_lens = result.accept_lens.to(torch.long)  # accepted drafts + 1 (root included)
        hidden = result.logits_output.hidden_states  # accepted path compacted to the front
        result.logits_output.hidden_states = None
        tic_extend = time.perf_counter()
        bs = len(roots)
        accept_index = result.accept_index.to(torch.long)[:, :width]  # [bs, <= width]
        path_tokens = torch.zeros(bs, width, dtype=torch.long, device=self.device)
        path_tokens[:, : accept_index.shape[1]] = packed.draft_tokens.to(self.device)[
            accept_index.clamp(min=0)
        ]
        # the n-gram trees alone were verified: the drafter reads this step's tokens later
        deferred = self._alone and self._rows is not None
        carried = self._follow(reqs, seq_lens, accept_lens, hidden, path_tokens, context,
                               state if deferred else None)  # fmt: skip
        draft_s += time.perf_counter() - tic_extend
        bonus = result.next_draft_input.bonus_tokens.to(torch.int64)
        result.next_draft_input = SpecBlockDraftInput(
            bonus_tokens=bonus, new_seq_lens=result.new_seq_lens, **carried
        )
        paths = accepted_path(result.accept_index, width)
        if self.ngram is not None:
            self.ngram.observe(drafted.trees, paths, time.perf_counter() - tic)
        if self.adapter is not None and width > 1:  # nothing drafted, nothing to learn
            self._adapt(batch, seq_lens_list, drafted, paths, path_tokens, hidden, result, width)
        self._observe(drafted, packed.num_nodes, paths, draft_s, tic, k)
        return result

    def _forward_plain(self, batch, state, tic: float, k: int):
        """Node budget 1: SGLang's plain decode forward of each root (``plain_step``), its
        token's rows kept for the drafter to read before it next drafts (``target_rows``)."""
        step = plain_step(self, batch, state.bonus_tokens, capture_hidden=True)
        bonus = state.bonus_tokens.to(torch.long)
        bs = bonus.shape[0]
        tic_store = time.perf_counter()
        # one row per request, at the slot the step wrote (no location lookup as for a verify)
        self._ensure_rows().store(step.locs, self._features(step.hidden[:bs]), bonus)
        pending = state.pending_count + 1
        draft_s = time.perf_counter() - tic_store
        next_input = SpecBlockDraftInput(
            bonus_tokens=step.tokens.to(torch.int64),
            new_seq_lens=batch.seq_lens + 1,
            root_cond=state.root_cond,
            pending_count=pending,
        )
        roots = DraftResult([DraftTree.rooted_at(t) for t in bonus.tolist()], 0)
        self._observe(roots, [1] * bs, [[0]] * bs, draft_s, tic, k)
        return plain_result(batch, step, next_input)

    def _plan_alone(self, reqs, seq_lens: list[int]) -> bool:
        """Whether this step verifies the n-gram trees alone (``NgramBranch.plan``): only where
        the controller would draft at this batch on a step time it measured here (a pure
        query); where it runs plain steps, those are what pays, and while it prices drafting
        from a bound its probes run back to back (steps without the drafter are no steps of
        its settings: between them a probe would stretch over seconds of such steps)."""
        if self.ngram is None:
            return False
        may_skip = self.controller is None or self.controller.expects_drafts(
            len(seq_lens), sum(seq_lens) // max(len(seq_lens), 1), measured=True
        )
        return self.ngram.plan(reqs, may_skip)

    def _choose_budget(self, seq_lens: list[int]) -> int:
        """This step's setting, an index into ``budgets``: the controller's, the next in turn
        (cycle), or the one fixed budget."""
        self._num_steps += 1
        if self.controller is None:
            k = self._num_steps % len(self.budgets)
        else:
            ctx = sum(seq_lens) // max(len(seq_lens), 1)
            self._decision = self.controller.decide(len(seq_lens), ctx)
            self.step_chosen(self._decision.k, len(seq_lens))
            k = self._decision.k
        self._last_budget = self.budgets[k]
        self._last_batch_size = len(seq_lens)
        return k

    def _adapt(self, batch, seq_lens, drafted, paths, path_tokens, hidden, result, width) -> None:
        """Feed the verify outcome to the online adapter (``adapt/serving.py``); it only changes
        later drafts, and a failure in it is logged, never raised."""
        try:
            bs, longest = len(paths), max(len(p) for p in paths)
            features = self._features(hidden[: bs * width]).view(bs, width, -1)[:, :longest]
            self.adapter.after_verify(
                request_keys(batch), seq_lens, [tree.parents for tree in drafted.trees],
                drafted.node_source, drafted.round_logits, paths, path_tokens, features,
                result.next_draft_input.bonus_tokens.tolist(),
            )  # fmt: skip
        except Exception:
            logger.exception("SPECBLOCK adapt: observing the verify failed; step skipped")

    def _catch_up_and_draft(self, reqs, seq_lens, state, roots, settings: DraftSettings):
        """The drafter reads the tokens it has not (``_catch_up``), then grows the trees."""
        tic = time.perf_counter()
        root_cond = self._catch_up(reqs, seq_lens, state.pending_count, state.root_cond)
        # reading what the drafter skipped while off is the switch's cost, not this budget's
        self.step_excludes(time.perf_counter() - tic)
        return self._draft(reqs, seq_lens, root_cond, roots, settings)

    def _draft(
        self, reqs, seq_lens, root_cond, roots, settings: DraftSettings
    ) -> tuple[DraftResult, PrefixContext | None]:
        """Grow the trees, and the drafter context they read (the extend after the verify
        reads the same rows); on any drafter failure verify the roots alone (plain decoding)."""
        try:
            prefix = self._gather_context(reqs, seq_lens, last_slot_only=True)
            drafted = grow_trees(
                self.drafter,
                prefix,
                root_cond.to(self.drafter_dtype),
                roots,
                seq_lens,
                settings,
                block_size=self.block_size,
            )
            return drafted, prefix
        except Exception:
            logger.exception("SPECBLOCK: drafting failed; verifying without drafts this step")
            return DraftResult([DraftTree.rooted_at(t) for t in roots], 0), None

    def _observe(
        self,
        drafted: DraftResult,
        num_nodes: list[int],
        paths: list[list[int]],  # per request, accepted nodes root first
        draft_s: float,
        tic: float,
        k: int,  # the controller's setting (budgets[k] nodes)
    ) -> None:
        offered = [
            offered_depth(tree.parents, path)
            for tree, path in zip(drafted.trees, paths, strict=True)
        ]
        step_s = time.perf_counter() - tic
        num_accepted = [len(p) - 1 for p in paths]
        self.stats.record_step(
            num_accepted, offered, num_nodes, drafted.num_forwards + 1, draft_s, step_s
        )
        self.metrics.observe_step(num_accepted, offered, draft_s, step_s - draft_s)
        self.metrics.observe_trees(num_nodes)
        if self.settings.budget != "fixed":  # auto, cycle, off: the budget of every step
            self.metrics.observe_k(self.budgets[k] - 1)
        if self.controller is not None and not self._alone:
            self.controller.observe_settings(
                observed_budgets(drafted.trees, paths, self.budgets, k, num_accepted)
            )
            realised = 1 + sum(num_accepted) / max(len(num_accepted), 1)
            self.metrics.observe_prediction(self._decision.lam, realised)
        if self.adapter is not None:
            bandit = self.adapter.bandit
            self.metrics.set_adaptation(bandit.num_updates, bandit.num_rollbacks)
        if self.stats.steps % LOG_EVERY_STEPS == 0:
            extra = " ".join(x.summary() for x in (self.adapter, self.ngram) if x is not None)
            logger.info(self.stats.summary(extra))
