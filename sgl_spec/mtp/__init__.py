"""Multi-token prediction with gated LoRA (MTP), the drafter of the large-batch paper §4.3.

One forward of the target over ``k + 1`` anchors, each followed by ``k`` mask tokens, both
verifies the current drafts (anchors, gate 0: the exact base model) and proposes the next ones
(masks, gate 1: base + LoRA). Modules, one role each:

- ``gated_lora``: the gated LoRA delta, the adapter (LoRA per linear + mask embeddings) and its
  attachment to a Hugging Face Llama/Qwen3 model.
- ``adapter_io``: the adapter config and its on-disk format (save / load / validation).
- ``layout``: slot order, positions, visibility and SGLang tree masks of one MTP step, and the
  equivalent training layout.
- ``data`` / ``trainer`` / ``evaluate`` / ``card`` / ``train``: the offline training pipeline of
  the shipped adapter (``python -m sgl_spec.mtp.train``).
"""
