"""Determinism harness: measure whether LLM inference gives the same output twice."""

__version__ = "0.1.0"
