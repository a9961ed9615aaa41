"""TOY_LOOKUP: a fourth algorithm added from outside ``sgl_spec`` (``docs/architecture.md``)."""
