"""Training the MTP gated-LoRA adapter offline: ``trainer`` (the loop over the target's greedy
continuations), ``evaluate`` (held-out mask acceptance), ``card`` (the model card). The command
line is ``python -m sgl_spec.mtp.train``."""
