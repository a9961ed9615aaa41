"""sgl-spec: speculative decoding algorithms for SGLang, shipped as a plugin."""

__version__ = "0.1.0"
