"""Corpus sources, tokenizer, binarization and batching."""
