"""The draft model of the MineDraft draft server: SGLang's ``ModelRunner`` with its own KV cache.

The draft server (``draft_server.py``) hosts the Drafter of paper §5.2 in its own process on its
own device. Its model runs through SGLang's ``ModelRunner`` (weights loading, attention backend,
``req_to_token`` pool and token allocator), driven directly with hand-built ``ForwardBatch``es:
one EXTEND over the tokens verified since the last step, then ``num_steps - 1`` DECODE forwards
for the chain of drafts.

KV ownership, per request (``_Sequence``): the verified tokens ``token_ids`` and the number of
leading tokens ``kv_len`` whose KV sits in the request's ``req_to_token`` row. Drafts are never
committed: the scheduler reports what verification accepted in the next request's
``appended_ids``, so the KV written while drafting (positions >= seq_len) is freed before
``draft`` returns. Between steps every verified token has KV except when a step appends nothing,
in which case the last token's slot is given back and re-run to get its logits.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

logger = logging.getLogger(__name__)


class DraftStateError(ValueError):
    """A request cannot be served (unknown rid, length mismatch, no room): drop it, not the
    server."""


@dataclass
class _Sequence:
    row: int  # req_to_token_pool row
    token_ids: list[int]  # verified tokens (prompt + accepted drafts + bonus tokens)
    kv_len: int  # leading tokens of token_ids whose KV is written in the row


def _free_port() -> int:
    """A free port below the kernel's ephemeral range, as SGLang picks its own NCCL port.

    The port is bound later (the rendezvous store). A port from ``bind(0)`` comes from the
    ephemeral range, where a client may have picked the target's HTTP port the same way, still
    unbound while the target loads: the draft's store then takes it and the target's server
    fails to bind.
    """
    from sglang.srt.utils.network import get_free_port_below_ephemeral

    return get_free_port_below_ephemeral()


# What every draft runner has, whatever its device: no prefix cache, graphs or overlap (the
# draft server builds its own batches), no warm-up request, one token per page.
RUNNER_FIXED = {"page_size": 1, "disable_radix_cache": True, "disable_cuda_graph": True,
                "disable_overlap_schedule": True, "skip_server_warmup": True,
                "mem_fraction_static": 0.8}  # fmt: skip


def build_model_runner(
    model_path: str, device: str, max_requests: int, max_total_tokens: int, seed: int
):
    """Boot SGLang's parallel runtime (world size 1) and a ``ModelRunner`` for the draft model.

    ``device`` is ``"cpu"`` or ``"cuda:N"``. CPU runs fp32 with the ``torch_native`` attention
    backend (no ``sgl_kernel`` library needed); CUDA keeps SGLang's default backend and dtype.
    CUDA graphs are off: the batches are built here, not by SGLang's scheduler.
    """
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed import bootstrap
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.runtime_context import SpawnRanks, get_device, publish, spawn_world_rank
    from sglang.srt.server_args import ServerArgs

    kind, _, index = device.partition(":")
    gpu_id = int(index or 0) if kind != "cpu" else 0
    on_cpu = kind == "cpu"
    server_args = ServerArgs(
        model_path=model_path,
        device=kind,
        base_gpu_id=gpu_id,
        attention_backend="torch_native" if on_cpu else None,
        dtype="float32" if on_cpu else "auto",
        port=_free_port(),
        max_running_requests=max_requests,
        max_total_tokens=max_total_tokens,
        random_seed=seed,
        **RUNNER_FIXED,
    )
    server_args.resolve_once()
    publish(
        server_args,
        role="scheduler",
        ranks=SpawnRanks(
            world_rank=spawn_world_rank(server_args, tp_rank=0, pp_rank=0), gpu_id=gpu_id
        ),
    )
    model_config = ModelConfig.from_server_args(server_args)
    dist_port = _free_port()
    bootstrap.init_parallel_runtime(
        server_args=server_args, device=get_device().device, dist_port=dist_port
    )
    bootstrap.init_layer_runtime(model_config=model_config)
    runner = ModelRunner(
        model_config=model_config,
        mem_fraction_static=0.8,
        gpu_id=gpu_id,
        nccl_port=dist_port,
        server_args=server_args,
    )
    runner.alloc_memory_pool()
    runner.init_attention_backends()
    runner.init_cuda_graphs()  # eager runners (graphs disabled); forward() expects them
    return runner


class SequenceTable:
    """Membership and lengths of the sequences a draft-server model holds (``_seqs``: rid ->
    an object with ``token_ids``)."""

    _seqs: dict

    def __contains__(self, rid: str) -> bool:
        return rid in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    def seq_len(self, rid: str) -> int:
        return len(self._seqs[rid].token_ids)


class DraftModel(SequenceTable):
    """Per-request draft KV over one ``ModelRunner``: add / append / free, then ``draft``.

    ``add``/``append`` only record tokens; the KV of new tokens is computed by the EXTEND of the
    next ``draft`` call, batched over all requests of the step.
    """

    def __init__(self, runner, num_steps: int, seed: int = 0) -> None:
        from sglang.srt.model_executor.forward_batch_info import (
            CaptureHiddenMode,
            ForwardBatch,
            ForwardMode,
        )

        self._fb = (ForwardBatch, ForwardMode, CaptureHiddenMode)
        self.runner = runner
        self.num_steps = num_steps
        self.device = torch.device(runner.device)
        self.vocab_size = int(runner.model_config.vocab_size)
        self.req_to_token = runner.req_to_token_pool.req_to_token  # [rows, max_context_len]
        self.max_context_len = self.req_to_token.shape[1]
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self._seqs: dict[str, _Sequence] = {}
        self._num_kv_slots = int(runner.token_to_kv_pool_allocator.available_size())

    # -- sequence state ----------------------------------------------------------------------

    def add(self, rid: str, token_ids: list[int], features: object = None) -> None:
        """Start a new sequence (replacing any old one with this rid). ``features`` are for
        the SpecBlock drafter (``specblock_host``); a draft LM reads tokens only."""
        self.free(rid)
        if not token_ids:
            raise DraftStateError(f"{rid}: empty sequence")
        self._check_room(rid, len(token_ids))
        rows = self.runner.req_to_token_pool.alloc_rows(1)
        if not rows:
            raise DraftStateError(f"{rid}: no free request slot ({len(self)} requests held)")
        self._seqs[rid] = _Sequence(row=rows[0], token_ids=list(token_ids), kv_len=0)

    def append(self, rid: str, token_ids: list[int], features: object = None) -> None:
        seq = self._seqs.get(rid)
        if seq is None:
            raise DraftStateError(f"{rid}: unknown request (never sent with its prompt)")
        self._check_room(rid, len(seq.token_ids) + len(token_ids))
        seq.token_ids.extend(token_ids)

    def free(self, rid: str) -> None:
        """Give back the request's KV slots and row; unknown rids are ignored."""
        seq = self._seqs.pop(rid, None)
        if seq is None:
            return
        self._free_slots(seq, 0)
        self.runner.req_to_token_pool.free_rows([seq.row])

    def check_kv_accounting(self) -> None:
        """Every allocated KV slot belongs to a held token (no draft KV left behind, nothing
        freed twice); raises AssertionError otherwise. For tests and debugging."""
        allocator = self.runner.token_to_kv_pool_allocator
        held = sum(s.kv_len for s in self._seqs.values())
        free = int(allocator.available_size())
        if free + held != self._num_kv_slots:
            raise AssertionError(
                f"draft KV accounting: {free} free + {held} held != {self._num_kv_slots} slots"
            )

    def _check_room(self, rid: str, length: int) -> None:
        # The KV of all drafts but the last lies past the verified tokens while drafting.
        if length + self.num_steps - 1 > self.max_context_len:
            raise DraftStateError(
                f"{rid}: {length} tokens + {self.num_steps} drafts exceed the draft"
                f" context length {self.max_context_len}"
            )

    def _free_slots(self, seq: _Sequence, start: int) -> None:
        """Free the KV slots of positions ``start .. kv_len-1`` of the row."""
        if seq.kv_len > start:
            slots = self.req_to_token[seq.row, start : seq.kv_len].to(torch.int64)
            self.runner.token_to_kv_pool_allocator.free(slots)
            seq.kv_len = start

    def _alloc(self, num_tokens: int) -> torch.Tensor:
        slots = self.runner.token_to_kv_pool_allocator.alloc(num_tokens)
        if slots is None:
            raise DraftStateError(f"draft KV cache full ({num_tokens} slots wanted)")
        return slots

    # -- drafting ----------------------------------------------------------------------------

    @torch.no_grad()
    def draft(
        self, rids: list[str], temperatures: list[float]
    ) -> list[tuple[np.ndarray, np.ndarray | None]]:
        """Draft a chain of ``self.num_steps`` tokens for each of ``rids`` (all held).

        Temperature 0 takes the argmax; otherwise the token is sampled from
        ``softmax(logits / T)``, which is returned as that position's draft distribution q.
        Returns per rid ``(draft_ids [num_steps] int32, draft_probs [num_steps, vocab] | None)``.
        On any error every listed rid is dropped (its state is no longer trustworthy) and the
        error re-raised.
        """
        seqs = [self._seqs[rid] for rid in rids]
        temps = torch.tensor(temperatures, dtype=torch.float32, device=self.device)  # [bs]
        try:
            for seq in seqs:  # something to run for every request, see the module docstring
                if seq.kv_len == len(seq.token_ids):
                    self._free_slots(seq, seq.kv_len - 1)
            ids, probs = [], []
            logits = self._extend(seqs)
            for step in range(self.num_steps):
                if step:
                    logits = self._decode(seqs, ids[-1])
                token, q = self._sample(logits, temps)
                ids.append(token)
                probs.append(q)
        except Exception:
            for rid in rids:
                self.free(rid)
            raise
        for seq in seqs:  # roll back: drafts are not verified tokens
            self._free_slots(seq, len(seq.token_ids))
        draft_ids = torch.stack(ids, dim=1).to(torch.int32).cpu().numpy()  # [bs, num_steps]
        sampled = [t > 0 for t in temperatures]
        draft_probs = (
            torch.stack(probs, dim=1).cpu().numpy() if any(sampled) else None
        )  # [bs, num_steps, vocab]
        return [(draft_ids[i], draft_probs[i] if sampled[i] else None) for i in range(len(seqs))]

    def _sample(
        self,
        logits: torch.Tensor,  # [bs, vocab]
        temps: torch.Tensor,  # [bs]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        logits = logits[:, : self.vocab_size].float()
        greedy = logits.argmax(dim=-1)  # [bs]
        sampled = temps > 0
        if not bool(sampled.any()):
            return greedy, logits[:, :0]
        probs = torch.softmax(logits / torch.where(sampled, temps, 1.0)[:, None], dim=-1)
        draws = torch.multinomial(probs, 1, generator=self.generator).squeeze(1)  # [bs]
        return torch.where(sampled, draws, greedy), probs

    def _extend(self, seqs: list[_Sequence]) -> torch.Tensor:
        """EXTEND over every token without KV; returns the last position's logits [bs, vocab]."""
        prefix_lens = [s.kv_len for s in seqs]
        seq_lens = [len(s.token_ids) for s in seqs]
        extend_lens = [n - p for n, p in zip(seq_lens, prefix_lens, strict=True)]
        num_tokens = sum(extend_lens)
        slots = self._alloc(num_tokens)
        offset = 0
        for seq, n in zip(seqs, extend_lens, strict=True):
            self.req_to_token[seq.row, seq.kv_len : seq.kv_len + n] = slots[offset : offset + n].to(
                torch.int32
            )
            seq.kv_len += n
            offset += n
        input_ids = [t for s, p in zip(seqs, prefix_lens, strict=True) for t in s.token_ids[p:]]
        positions = [i for p, n in zip(prefix_lens, seq_lens, strict=True) for i in range(p, n)]
        starts = np.cumsum([0, *extend_lens[:-1]]).tolist()
        fields = dict(
            extend_num_tokens=num_tokens,
            extend_seq_lens=self._tensor(extend_lens, torch.int32),
            extend_prefix_lens=self._tensor(prefix_lens, torch.int32),
            extend_start_loc=self._tensor(starts, torch.int32),
            extend_seq_lens_cpu=extend_lens,
            extend_prefix_lens_cpu=prefix_lens,
            extend_logprob_start_lens_cpu=extend_lens,
        )
        return self._forward("EXTEND", seqs, input_ids, positions, seq_lens, slots, fields)

    def _decode(self, seqs: list[_Sequence], last: torch.Tensor) -> torch.Tensor:
        """One DECODE forward feeding the previous draft token ``last`` [bs] at the next
        position of each row; returns logits [bs, vocab]."""
        slots = self._alloc(len(seqs))
        positions = []
        for i, seq in enumerate(seqs):
            self.req_to_token[seq.row, seq.kv_len] = slots[i].to(torch.int32)
            positions.append(seq.kv_len)
            seq.kv_len += 1
        seq_lens = [s.kv_len for s in seqs]  # decode convention: includes the new token
        return self._forward("DECODE", seqs, last, positions, seq_lens, slots, {})

    def _tensor(self, values: list[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

    def _forward(
        self,
        mode: str,
        seqs: list[_Sequence],
        input_ids: list[int] | torch.Tensor,  # [num_tokens]
        positions: list[int],  # [num_tokens]
        seq_lens: list[int],  # [bs]
        out_cache_loc: torch.Tensor,  # [num_tokens]
        extend_fields: dict,
    ) -> torch.Tensor:
        ForwardBatch, ForwardMode, CaptureHiddenMode = self._fb
        if not isinstance(input_ids, torch.Tensor):
            input_ids = self._tensor(input_ids, torch.int64)
        forward_batch = ForwardBatch(
            forward_mode=getattr(ForwardMode, mode),
            batch_size=len(seqs),
            input_ids=input_ids.to(self.device, torch.int64),
            req_pool_indices=self._tensor([s.row for s in seqs], torch.int64),
            seq_lens=self._tensor(seq_lens, torch.int64),
            seq_lens_cpu=torch.tensor(seq_lens, dtype=torch.int64),
            seq_lens_sum=sum(seq_lens),
            out_cache_loc=out_cache_loc.to(self.device, torch.int64),
            positions=self._tensor(positions, torch.int64),
            capture_hidden_mode=CaptureHiddenMode.NULL,
            spec_algorithm=self.runner.spec_algorithm,
            return_hidden_states_before_norm=False,
            **extend_fields,
        )
        self.runner.kv_index_translator.bind_own_plan(forward_batch)
        return self.runner.forward(forward_batch).logits_output.next_token_logits
