"""SpecBlock (block-iterative drafter with rank-guided dynamic trees): pure components.

``model`` holds the drafter (§3.1-3.2), ``mask`` its attention mask (App. A.2), ``rank`` the rank
head and its psi features and buckets (§3.2-3.3, App. B), ``tree`` the rank-guided tree of
Algorithm 2 and the verifier inputs. Paper: ../shared/seeds/specblock-block-iterative-drafter.txt.
"""
