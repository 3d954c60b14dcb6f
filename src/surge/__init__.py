"""surge: fast, cheap serving of transformer NLP models."""

__version__ = "0.1.0"
