"""``python -m sgl_spec.patches``: print ``docs/patches.md``."""

from sgl_spec.patches import patches_markdown

print(patches_markdown(), end="")
