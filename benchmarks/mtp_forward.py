"""The served forward of one MTP_LORA step, timed beside a plain chain verify of its width.

``forward_cost.py --mtp-adapter DIR`` runs this in a process of its own (a third "model" in
its ABBA order): the shipped target with the gated-LoRA adapter installed as the server
installs it (``install_gated_lora``), prefilled with ``--ctx-len`` tokens a request. Per batch
size and ``--mtp-ks`` k, two TARGET_VERIFY forwards of (k+1)² tokens a request alternate in a
shuffled order:

- ``mtp_lora``: what ``MtpLoraWorker.forward_decode`` runs: the k+1 anchors and their masks
  (``build_input_ids``), the layout's positions, its custom tree mask in the attention
  backend's format, and the mask rows gated onto the LoRA path (``GatedLoRA.gates``);
- ``chain``: the same width as a causal chain with no gate (the adapter's wrappers pass
  through): the plain verify ``cost_model.py`` prices every other verify with.

Only ``ModelRunner.forward`` is timed, as for every other row of ``forward_cost.py``. There is
no bare (Hugging Face) forward of a gated step: ``bare_ms`` is None.
"""

from __future__ import annotations

import argparse
import random
import statistics
from pathlib import Path


def _mtp_verify_batch(runner, batch, k: int, mask_token_ids: list[int]):
    """The TARGET_VERIFY ForwardBatch of k's step on ``batch``'s (k+1)² extend slots a request,
    and k's layout."""
    import torch
    from forward_cost import _verify_batch

    from sgl_spec.common.worker import backend_mask_mode
    from sgl_spec.mtp import layout as mtp_layout

    lay = mtp_layout.mtp_layout(k)
    width, bs = lay.width, len(batch.reqs)
    prefix = (batch.seq_lens - width).to(torch.int64)
    anchors = batch.input_ids.view(bs, width)[:, : k + 1].to(torch.int64)
    input_ids = mtp_layout.build_input_ids(anchors, mask_token_ids[:k])
    mode = int(backend_mask_mode(runner.attn_backend))
    mask = mtp_layout.tree_mask(lay, bs, mode, seq_lens=prefix)
    fb = _verify_batch(runner, batch, width, input_ids, lay.position_offsets, mask)
    return fb, lay


def step_gate(lora, k: int, lay):
    """The gate ``MtpLoraWorker`` enters around k's step: rows k+1.. of each block gated."""
    return lora.gates(lay.width, k + 1, lay.mask_index[k + 1 :])


def _timed(runner, lora, reqs, ctx: int, k: int, kind: str, mask_token_ids: list[int]) -> float:
    """One served forward of ``kind`` for k's width; frees its KV slots."""
    from forward_cost import _verify_batch
    from gamma_tolerance import build_extend, time_forward

    width = (k + 1) ** 2
    batch, _ = build_extend(runner, reqs, ctx, ctx + width)
    try:
        if kind == "chain":
            return time_forward(runner, _verify_batch(runner, batch, width))
        fb, lay = _mtp_verify_batch(runner, batch, k, mask_token_ids)
        with step_gate(lora, k, lay):
            return time_forward(runner, fb)
    finally:
        runner.token_to_kv_pool_allocator.free(batch.out_cache_loc)


def run_mtp_worker(model_path: str, adapter: str, args: argparse.Namespace) -> dict:
    """Median served latency (ms) of k's gated step and of a chain of its width, per batch."""
    import torch
    from forward_cost import _load_runner, prefilled

    runner = _load_runner(model_path, args)  # first: it prepares SGLang's environment
    from sgl_spec.mtp.adapter_io import load_adapter
    from sgl_spec.mtp.sglang_lora import install_gated_lora

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    hf_config = runner.model_config.hf_config
    _, config = load_adapter(adapter, hf_config)
    bad = [k for k in args.mtp_ks if not 1 <= k <= config.k_max]
    if bad:
        raise SystemExit(f"--mtp-ks {bad}: the adapter drafts k = 1..{config.k_max}")
    lora = install_gated_lora(
        runner.model, adapter, hf_config, dtype=runner.dtype, device=torch.device(runner.device)
    )
    mask_ids = list(config.mask_token_ids)
    rng = random.Random(0)
    points = []
    for bs in args.batch_sizes:
        reqs = prefilled(runner, bs, args.ctx_len, (max(args.mtp_ks) + 1) ** 2, rng)
        times = {(kind, k): [] for kind in ("mtp_lora", "chain") for k in args.mtp_ks}
        order = list(times)
        for i in range(args.warmup + args.iters):
            rng.shuffle(order)
            for kind, k in order:
                t = _timed(runner, lora, reqs, args.ctx_len, k, kind, mask_ids)
                if i >= args.warmup:
                    times[(kind, k)].append(t * 1e3)
        for (kind, k), ms in sorted(times.items()):
            points.append({"batch_size": bs, "num_tokens": (k + 1) ** 2, "ctx_len": args.ctx_len,
                           "shape": kind, "mtp_k": k, "bare_ms": None,
                           "served_ms": statistics.median(ms)})  # fmt: skip
            print(f"{Path(model_path).name}+mtp bs={bs} k={k} {kind}:"
                  f" served {points[-1]['served_ms']:.2f} ms", flush=True)  # fmt: skip
    return {"model": f"{model_path}+mtp", "torch_threads": torch.get_num_threads(),
            "points": points}  # fmt: skip
