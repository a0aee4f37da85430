"""Structured outputs: a grammar constrains which tokens a request may sample (xgrammar)."""
