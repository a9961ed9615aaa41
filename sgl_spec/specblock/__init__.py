"""SpecBlock (block-iterative drafter with rank-guided dynamic trees): pure components.

``model`` holds the drafter (§3.1-3.2), ``mask`` its attention mask (App. A.2), ``rank`` the rank
head and its psi features and buckets (§3.2-3.3, App. B), ``tree`` the rank-guided tree of
Algorithm 2 and the verifier inputs. Training (§3.3, §4.1): ``data`` (target-written sequences,
target features, draft vocabulary), ``layout`` (block chains over a sequence), ``losses``
(valid-prefix mask, Eq. 7), ``trainer`` (the step; the loop is ``sgl_spec.training``),
``evaluate`` (held-out α_k, τ, rank buckets), ``card`` and the CLI ``train``.
Paper: ../shared/seeds/specblock-block-iterative-drafter.txt.
"""
