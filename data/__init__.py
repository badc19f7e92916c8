"""Corpora, tokenizers and the cached token files that train.py reads."""
