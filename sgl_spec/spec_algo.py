"""Common base of our registered algorithms whose draft state lives in their own worker."""

from __future__ import annotations

from typing import Any

from sglang.srt.speculative.spec_registry import CustomSpecAlgo


class OwnDraftStateSpecAlgo(CustomSpecAlgo):
    """Duck-typed SGLang algorithm without a draft KV pool in SGLang (MTP_LORA drafts with the
    target, SPECBLOCK keeps its drafter's KV in its worker)."""

    def has_draft_kv(self) -> bool:
        return False

    # Methods SGLang's enum has and its CustomSpecAlgo base lacks (0.5.23).
    def carries_draft_hidden_states(self) -> bool:
        return False

    def need_topk(self) -> bool:
        return False

    def get_platform_worker_cls(self) -> type | None:
        return None

    def create_future_map(self, *args: Any, **kwargs: Any) -> Any:
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        return SpeculativeAlgorithm.create_future_map(self, *args, **kwargs)


def require_single_rank(name: str, server_args: Any) -> None:
    """Refuse tensor / pipeline / data parallelism, which ``name`` does not support yet."""
    for flag in ("tp_size", "pp_size", "dp_size"):
        if int(getattr(server_args, flag, 1) or 1) != 1:
            raise ValueError(f"{name} supports --{flag.replace('_', '-')} 1 only for now")
