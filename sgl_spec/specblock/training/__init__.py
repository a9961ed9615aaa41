"""Training the SpecBlock drafter offline: ``trainer`` (the valid-prefix training loop),
``losses``, ``data`` (the target's greedy continuations and features), ``evaluate`` (held-out
acceptance), ``card`` (the model card). The command line is ``python -m sgl_spec.specblock.train``."""
