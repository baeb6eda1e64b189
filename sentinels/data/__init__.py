"""Data pipeline: tokenizers, document sources, token-window batches with next-token labels."""
