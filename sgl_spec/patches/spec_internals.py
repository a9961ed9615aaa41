"""Patch: none installed at start-up; the SGLang internals sgl-spec's workers lean on without a
public interface, checked here like every patch so that a changed SGLang is refused at start.

Upstream targets (SGLang 0.5.23):

- ``sglang.srt.speculative.spec_info.SpecInputType.UNO_STATE``: the carried per-request draft
  state of our workers (``common/draft_input.py``) declares itself with this member, which
  SGLang documents as "carried state, not a forward input"; plugins cannot add enum members.
- ``sglang.srt.speculative.eagle_worker_common.run_eagle_verify``: it compacts the accepted
  path of each request to the front of its rows only for ``topk > 1`` (and fuses the commit
  only for ``topk == 1``); our irregular trees (``common/tree_verify.py``) pass ``topk=2`` to
  get the compaction, whatever their real branching.
- ``sglang.srt.models.llama``: the gated LoRA of multi-token prediction wraps, per model
  instance at worker start-up, the ``forward`` of each layer's fused projections
  (``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj``) and of ``embed_tokens``, and gates
  the MLP's fused ``dual_gemm`` path through its ``can_run``; the layers must call those
  modules the way the wrappers expect.
"""

from __future__ import annotations

import inspect

from sgl_spec.config import SpecConfig

TARGET = (
    "sglang.srt.speculative.spec_info",
    "sglang.srt.speculative.eagle_worker_common",
    "sglang.srt.models.llama",
)
# What each function's source must contain for our use of it to hold.
_VERIFY_SOURCE = ("finalize_tree_path and", "topk > 1", "fused_commit_outputs and topk == 1")
_LLAMA_SOURCE = {
    "LlamaAttention.__init__": ("self.qkv_proj =", "self.o_proj ="),
    "LlamaAttention.forward_prepare_native": ("self.qkv_proj(",),
    "LlamaAttention.forward": ("self.o_proj(",),
    "LlamaMLP.__init__": ("self.gate_up_proj =", "self.down_proj =", "self.dual_gemm ="),
    "LlamaMLP.forward": ("self.dual_gemm.can_run(", "self.gate_up_proj(x)", "self.down_proj(x)"),
    "LlamaModel.__init__": ("self.embed_tokens =", "self.layers"),
}


def enabled(config: SpecConfig) -> bool:
    del config
    return True  # checks only: every algorithm's workers may rely on these


def _require(source: str, needles: tuple[str, ...], where: str) -> None:
    for needle in needles:
        if needle not in source:
            raise RuntimeError(f"{where} no longer contains {needle!r}")


def check() -> None:
    """Raise if the pinned SGLang no longer has the shape these couplings expect."""
    import importlib

    from sglang.srt.speculative import eagle_worker_common
    from sglang.srt.speculative.spec_info import SpecInputType

    if not hasattr(SpecInputType, "UNO_STATE"):
        raise RuntimeError("SpecInputType.UNO_STATE is gone")
    verify = eagle_worker_common.run_eagle_verify
    params = set(inspect.signature(verify).parameters)
    if not {"topk", "num_draft_tokens", "finalize_tree_path"} <= params:
        raise RuntimeError(f"run_eagle_verify params: {sorted(params)}")
    _require(inspect.getsource(verify), _VERIFY_SOURCE, "run_eagle_verify")
    llama = importlib.import_module("sglang.srt.models.llama")
    for qualname, needles in _LLAMA_SOURCE.items():
        cls_name, method = qualname.split(".")
        _require(inspect.getsource(getattr(getattr(llama, cls_name), method)), needles, qualname)


def apply() -> bool:
    """Nothing to install: the couplings are checked, the wrappers are per model instance."""
    check()
    return False
