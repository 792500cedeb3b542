"""livedraft data plane: speculative decoding engine, drafters, model loading."""

__version__ = "0.1.0"
