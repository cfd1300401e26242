"""Corpus sources, tokenizer, binarization and batching (§5.1-5.2).

  sources.py    read a corpus (Hugging Face, local text files, or the built-in toy corpus)
  tokenizer.py  the shared SentencePiece BPE vocabulary, with fixed special ids
  binarize.py   encode text into token shards, in parallel worker processes
  prepare.py    prepare(cfg): the whole pipeline into one directory, resumable
  dataset.py    ShardDataset: a prepared split, memory-mapped; a batch read with one gather per side
  batching.py   token-budget batches (TokenBudgetBatchSampler) and padding (collate, pad_batch)
  corpus.py     the prepared corpus as training reads it: a rank's batches, the valid split
  toy.py        the synthetic English-German corpus

The package imports nothing itself, so worker processes that only encode text stay light.
"""
