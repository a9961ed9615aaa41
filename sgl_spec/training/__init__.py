"""What every offline training pipeline has in common: the shipped target/draft pair
(``sgl_spec.models.build``), the MTP adapter (``sgl_spec.mtp.training``) and the SpecBlock drafter
(``sgl_spec.specblock.training``). It sits below the algorithms and knows none of them; each
pipeline keeps its own model, batch layout, loss, optimizer, evaluation and card text.

- ``schedule``: ``ScheduleConfig`` (the optimisation fields every train config extends), the LR
  schedule (warm-up / constant / cosine) and the check that a resume reproduces its run.
- ``loop``: the one optimisation loop (LR, step, backward, clip, optimizer step, timing, progress
  bar, checkpoints, early stop, exact resume) around a per-pipeline step function.
- ``checkpoint``: the checkpoint's contents, its atomic save and its checked load.
- ``acceptance``: the acceptance rates along the target's greedy continuation that every
  held-out evaluation reports (α_k, all-right prefixes, expected acceptance length).
- ``greedy_data``: the target's greedy continuations, cached train/eval sets of them.
- ``card``: the model-card files and markdown building blocks, the adapter/drafter card layout.
- ``cli``: the adapter and drafter CLIs' shared flags, frozen target, greedy splits, run
  options, ``training.json`` entries and the closing card-and-report step.
"""
