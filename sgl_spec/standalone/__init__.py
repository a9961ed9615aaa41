"""STANDALONE_FULL: SGLang's STANDALONE speculative decoding (a separate draft language model
drafts, the target verifies) with the draft reading the whole sequence, token 0 included.

SGLang's STANDALONE worker inherits EAGLE's draft layout, which shifts the draft's input ids
left by one: right for an EAGLE head (it pairs the target's hidden state ``p`` with token
``p + 1``), wrong for a plain language model, whose context then silently loses token 0 (for
Llama-family models the BOS token, their attention sink). ``draft.py`` is our subclass of
SGLang's draft worker that keeps the draft's KV unshifted; ``hook.py`` has SGLang build it in
place of its own (SGLang's plugin hook registry) when the launch asks for STANDALONE_FULL.
The launcher passes SGLang ``STANDALONE`` for it, so every other part of SGLang treats it as
its own STANDALONE; ``--speculative-algorithm STANDALONE`` keeps SGLang's layout unchanged.
"""

# Our name for it: the launcher's --speculative-algorithm value and its metrics' label.
NAME = "STANDALONE_FULL"
