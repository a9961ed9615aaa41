"""The test suite: ``unit/`` (no server process; ``pytest -m "not server"`` is the fast lane),
``e2e/`` (real SGLang servers and draft servers), ``helpers/`` (tiny models, server harness,
lossless checks)."""
