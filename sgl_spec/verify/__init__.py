"""Lossless acceptance rules as pure functions (no requests, pools or sockets).

Vocabulary used throughout sgl-spec: the *draft* proposes tokens, the *target* verifies them;
*accepted* drafts are the ones the target keeps; the *bonus* token is the one the target adds
after the last accepted draft (sampled from the residual, or from the target at the end of a
fully accepted path). The *acceptance length* of one verify step = accepted drafts + 1 bonus.
"""
