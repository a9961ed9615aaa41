"""Shared test helpers: tiny models built on the fly, the server wrapper, lossless checks."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
