"""SPECBLOCK's cost-aware online adaptation (paper §3.4, Algorithm 1): ``policy`` (the bandit
and its configuration), ``update`` (training a copy of the drafter), ``serving`` (the glue the
worker calls at step boundaries)."""
