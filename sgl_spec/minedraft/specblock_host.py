"""The SpecBlock drafter hosted by the MineDraft draft server (``--minedraft-drafter specblock``).

MineDraft verifies chains, so the drafter grows one: ``M = ceil(num_steps / K)`` blocks, each
position keeping its top-1 token and every block starting at the end of the previous one
(``drafting.grow_trees`` with width 1 everywhere), cut to ``num_steps`` drafts. The drafter
conditions on the target's (low, mid, top) features (paper §3.1), which live in the scheduler:
each ``DraftEntry`` carries the feature rows of the positions verified since the last one
(``DraftEntry.features``). Per request this model holds, as the SPECBLOCK worker does in the
target's process:

- ``token_ids``: the verified tokens; the last one (the next verify's root) has no features yet;
- the drafter's own KV cache, one block of K slots per featured position (paper App. A.2,
  source 1), written by the *extend* forward over newly featured positions (``extend_prefix``);
- ``root_cond``: the drafter state at slot 1 of the last extend block, which the first block of
  the next chain starts from (the cross-block start with cut ``s = 1``).

A request whose features are incomplete -- re-sent with its prompt after a draft-server restart
or a dropped update, when the scheduler no longer holds the earlier rows -- is kept *blind*: it
gets no drafts (the scheduler verifies it target-only, still lossless) until it leaves.

Drafts are greedy whatever the request's temperature: MineDraft's verify is target-only
rejection sampling, whose output law is the target's whatever the drafts (``worker.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from sgl_spec.minedraft.draft_model import DraftStateError, SequenceTable
from sgl_spec.patches.cpu_packed_linear import pack_linear_modules
from sgl_spec.specblock.drafting import DraftSettings, PrefixContext, extend_prefix, grow_trees
from sgl_spec.specblock.model import SpecBlockDrafter
from sgl_spec.specblock.workspace import KVWorkspace
from sgl_spec.verify.packing import context_visibility

EXTEND_CHUNK = 256  # positions per extend forward (bounds its [S*K, C + S*K] mask)


@dataclass
class _Sequence:
    token_ids: list[int]
    blind: bool = False  # features incomplete: never drafted
    pending: list[np.ndarray] = field(default_factory=list)  # feature rows not yet extended
    num_pending: int = 0
    num_featured: int = 0  # positions whose drafter KV block is stored
    keys: list[torch.Tensor] = field(default_factory=list)  # per layer [cap, K, n_kv, hd]
    values: list[torch.Tensor] = field(default_factory=list)
    root_cond: torch.Tensor | None = None  # [d] after the last extend


class SpecBlockChainModel(SequenceTable):
    """The draft server's model for a SpecBlock drafter: the ``DraftModel`` interface
    (``add`` / ``append`` / ``free`` / ``draft``) with feature rows riding along."""

    def __init__(self, drafter: SpecBlockDrafter, num_steps: int, max_context_len: int) -> None:
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        self.drafter = drafter.eval()
        cfg = drafter.config
        self.block_size = cfg.block_size
        self.num_steps = num_steps
        self.max_context_len = max_context_len
        self.feature_width = 3 * cfg.target_hidden_size
        self.vocab_size = cfg.target_vocab_size
        num_blocks = math.ceil(num_steps / cfg.block_size)
        self.settings = DraftSettings(
            num_blocks=num_blocks,
            bucket_map=(1, 1, 1, 1),  # top-1 at every position: a chain
            max_nodes=1 + num_blocks * cfg.block_size,
            max_starts=1,
            fixed_width=1,
        )
        param = next(drafter.parameters())
        self.device, self.dtype = param.device, param.dtype
        self._seqs: dict[str, _Sequence] = {}

    @classmethod
    def load(
        cls, path: str, device: str, num_steps: int, max_context_len: int
    ) -> SpecBlockChainModel:
        """The drafter at ``path`` on ``device``: fp32 on CPU, bf16 on CUDA."""
        drafter = SpecBlockDrafter.from_pretrained(path)
        dtype = torch.float32 if device.startswith("cpu") else torch.bfloat16
        drafter = drafter.to(device=device, dtype=dtype)
        pack_linear_modules(drafter)  # float32 on the CPU: the target's packed kernel
        return cls(drafter, num_steps, max_context_len)

    # -- sequence state ----------------------------------------------------------------------

    def is_blind(self, rid: str) -> bool:
        return self._seqs[rid].blind

    def add(self, rid: str, token_ids: list[int], features: np.ndarray | None = None) -> None:
        """Start ``rid``; ``features`` should hold a row for every token but the last."""
        self.free(rid)
        if not token_ids:
            raise DraftStateError(f"{rid}: empty sequence")
        self._check_room(rid, len(token_ids))
        seq = _Sequence(list(token_ids))
        self._seqs[rid] = seq
        rows = self._rows(rid, features)
        if rows is None or len(rows) != len(token_ids) - 1:
            seq.blind = True  # re-sent without its history: verified target-only
        elif len(rows):
            seq.pending.append(rows)
            seq.num_pending = len(rows)

    def append(self, rid: str, token_ids: list[int], features: np.ndarray | None = None) -> None:
        """Append verified tokens; ``features`` holds the rows of the positions that gained
        them (the previous root and the accepted drafts: one per appended token)."""
        seq = self._seqs.get(rid)
        if seq is None:
            raise DraftStateError(f"{rid}: unknown request (never sent with its prompt)")
        self._check_room(rid, len(seq.token_ids) + len(token_ids))
        rows = self._rows(rid, features)
        if rows is not None and len(rows) != len(token_ids):
            raise DraftStateError(
                f"{rid}: {len(rows)} feature rows for {len(token_ids)} appended tokens"
            )
        seq.token_ids.extend(token_ids)
        if rows is None:  # the scheduler lost this request's features
            seq.blind = True
        elif not seq.blind and len(rows):
            seq.pending.append(rows)
            seq.num_pending += len(rows)

    def free(self, rid: str) -> None:
        self._seqs.pop(rid, None)

    def check_kv_accounting(self) -> None:
        """Every drafted request has one KV block per featured position and features for
        every token but the last; AssertionError otherwise."""
        for rid, seq in self._seqs.items():
            if seq.blind:
                continue
            if seq.num_featured + seq.num_pending != len(seq.token_ids) - 1:
                raise AssertionError(
                    f"{rid}: {seq.num_featured} extended + {seq.num_pending} pending feature"
                    f" rows for {len(seq.token_ids)} tokens"
                )
            if seq.keys and seq.keys[0].shape[0] < seq.num_featured:
                raise AssertionError(f"{rid}: drafter KV holds fewer rows than positions")

    def _rows(self, rid: str, features: np.ndarray | None) -> np.ndarray | None:
        if features is None:
            return None
        if features.ndim != 2 or features.shape[1] != self.feature_width:
            raise DraftStateError(
                f"{rid}: feature rows must be [n, {self.feature_width}], got {features.shape}"
            )
        return features

    def _check_room(self, rid: str, length: int) -> None:
        if length + self.num_steps > self.max_context_len:
            raise DraftStateError(
                f"{rid}: {length} tokens + {self.num_steps} drafts exceed the drafter's"
                f" context length {self.max_context_len}"
            )

    # -- drafting ----------------------------------------------------------------------------

    @torch.no_grad()
    def draft(
        self, rids: list[str], temperatures: list[float]
    ) -> list[tuple[np.ndarray, np.ndarray | None]]:
        """A chain of ``num_steps`` greedy drafts per rid (none for blind ones). On an error
        every listed rid is dropped and the error re-raised."""
        del temperatures  # greedy drafts for every request (module docstring)
        seqs = [self._seqs[rid] for rid in rids]
        try:
            self._extend([s for s in seqs if not s.blind and s.num_pending])
            ready = [i for i, s in enumerate(seqs) if not s.blind and s.root_cond is not None]
            chains = self._chains([seqs[i] for i in ready]) if ready else []
        except Exception:
            for rid in rids:
                self.free(rid)
            raise
        out: list[tuple[np.ndarray, np.ndarray | None]] = [
            (np.zeros(0, np.int32), None) for _ in rids
        ]
        for i, chain in zip(ready, chains, strict=True):
            out[i] = (chain, None)
        return out

    def _extend(self, seqs: list[_Sequence]) -> None:
        """Training's pass 1 over every pending featured position, ``EXTEND_CHUNK`` at a time."""
        for seq in seqs:
            rows = np.concatenate(seq.pending) if len(seq.pending) > 1 else seq.pending[0]
            seq.pending = [rows]
        while seqs:
            counts = [min(s.num_pending, EXTEND_CHUNK) for s in seqs]
            s_max = max(counts)
            bs = len(seqs)
            features = torch.zeros(bs, s_max, self.feature_width, dtype=self.dtype)
            tokens = torch.zeros(bs, s_max, dtype=torch.long)
            positions = torch.zeros(bs, s_max, dtype=torch.long)
            for b, (seq, n) in enumerate(zip(seqs, counts, strict=True)):
                start = seq.num_featured
                features[b, :n] = torch.from_numpy(seq.pending[0][:n]).to(self.dtype)
                tokens[b, :n] = torch.tensor(seq.token_ids[start : start + n])
                positions[b] = start + torch.arange(s_max)
            num_new = torch.tensor(counts, device=self.device)
            prefix = self._context(seqs, [s.num_featured for s in seqs], last_slot_only=False)
            result = extend_prefix(
                self.drafter,
                prefix,
                features.to(self.device),
                tokens.to(self.device),
                positions.to(self.device),
                num_new,
            )
            k = self.block_size
            for b, (seq, n) in enumerate(zip(seqs, counts, strict=True)):
                blocks = []
                for key, value in result.kv:  # [bs, n_kv, S*K, hd]
                    pair = []
                    for t in (key, value):
                        n_kv, hd = t.shape[1], t.shape[3]
                        rows = t[b].view(n_kv, s_max, k, hd)[:, :n].permute(1, 2, 0, 3)
                        pair.append(rows)  # [n, K, n_kv, hd]
                    blocks.append(pair)
                self._store(seq, blocks, n)
                seq.root_cond = result.root_cond[b].clone()
                seq.pending = [seq.pending[0][n:]]
                seq.num_pending -= n
            seqs = [s for s in seqs if s.num_pending]

    def _store(self, seq: _Sequence, blocks: list[list[torch.Tensor]], n: int) -> None:
        """Append ``n`` KV blocks per layer, doubling the row capacity when it runs out."""
        need = seq.num_featured + n
        for layer, (key, value) in enumerate(blocks):
            if layer >= len(seq.keys):
                cap = max(need, 64)
                seq.keys.append(key.new_zeros(cap, *key.shape[1:]))
                seq.values.append(value.new_zeros(cap, *value.shape[1:]))
            elif seq.keys[layer].shape[0] < need:
                cap = max(need, 2 * seq.keys[layer].shape[0])
                for store in (seq.keys, seq.values):
                    grown = store[layer].new_zeros(cap, *store[layer].shape[1:])
                    grown[: seq.num_featured] = store[layer][: seq.num_featured]
                    store[layer] = grown
            seq.keys[layer][seq.num_featured : need] = key
            seq.values[layer][seq.num_featured : need] = value
        seq.num_featured = need

    def _context(
        self, seqs: list[_Sequence], num_tokens: list[int], last_slot_only: bool
    ) -> PrefixContext:
        """The cached drafter KV of ``seqs`` (their first ``num_tokens`` positions), padded
        across the batch, with its visibility."""
        k = self.block_size
        t = max(max(num_tokens), 1)
        counts = torch.tensor(num_tokens, device=self.device)
        num_layers = self.drafter.config.num_layers
        _, n_kv, hd = self._kv_row_shape()
        workspace = KVWorkspace.empty(
            num_layers, len(seqs), t * k, n_kv, hd, self.dtype, self.device
        )
        for layer in range(num_layers):
            for which, buffers in (("keys", workspace.keys), ("values", workspace.values)):
                padded = buffers[layer][:, : t * k].view(len(seqs), t, k, n_kv, hd)
                padded.zero_()
                for b, (seq, n) in enumerate(zip(seqs, num_tokens, strict=True)):
                    store = getattr(seq, which)
                    if n and store:
                        padded[b, :n] = store[layer][:n]
        visible = context_visibility(counts, t, k, last_slot_only)
        return PrefixContext(workspace, visible)

    def _kv_row_shape(self) -> tuple[int, int, int]:
        from sgl_spec.specblock.draft_kv import drafter_kv_shape

        _, k, heads, head_dim = drafter_kv_shape(self.drafter.config)
        return k, heads, head_dim

    def _chains(self, seqs: list[_Sequence]) -> list[np.ndarray]:
        """Grow one chain per sequence from its root (the last verified token)."""
        featured = [s.num_featured for s in seqs]
        prefix = self._context(seqs, featured, last_slot_only=True)
        root_cond = torch.stack([s.root_cond for s in seqs])
        roots = [s.token_ids[-1] for s in seqs]
        positions = torch.tensor([len(s.token_ids) - 1 for s in seqs], device=self.device)
        result = grow_trees(self.drafter, prefix, root_cond, roots, positions, self.settings)
        chains = []
        for tree in result.trees:
            chain, node = [], 0
            children = {p: i for i, p in enumerate(tree.parents) if i}
            while len(chain) < self.num_steps and node in children:
                node = children[node]
                chain.append(tree.tokens[node])
            chains.append(np.asarray(chain, dtype=np.int32))
        return chains
