"""What every sgl-spec algorithm shares: the algorithm interface (``algorithm``), the worker base
that wraps SGLang's target worker (``worker``), the carried per-request state
(``draft_input``) and the one tree-verify call (``tree_verify``)."""
