"""The speculation controller every algorithm shares: per step, the setting (drafts, tree
nodes, or none) of highest predicted tokens per second, from measured step times and the
running acceptance.

- ``controller``: ``SpeculationController``; ``config``: its ``ControllerConfig`` and defaults.
- ``chain_steps``, ``budget``: the controllers over a chain's length and over tree node budgets.
- ``acceptance``: λ(k) per setting (a chain's per-position α, or per-budget estimates).
- ``step_times``: served step times per batch-size bucket and setting (online calibration).
- ``probes``: the least wait between probes while off, so that they cost at most a share of time.
- ``cost_model``: equation 1 of the large-batch paper and its measured γ-tolerance table.
- ``ranks``: one setting per step across tensor-parallel ranks (rank 0's).
"""
