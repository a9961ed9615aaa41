"""What the offline training pipelines of the MTP adapter (``sgl_spec.mtp``) and the SpecBlock
drafter (``sgl_spec.specblock``) have in common; each pipeline keeps its own model, batch layout,
loss, evaluation and card text.

- ``loop``: the optimisation loop (LR schedule, backward, clip, step, timing, progress bar,
  checkpoints, exact resume) around a per-pipeline step function.
- ``cli``: the shared command-line flags, the frozen target, the train/eval greedy data, and the
  derived card name, reproduce command and checkpoint location.
"""
