"""Inference (§6.1): the `Translator` (a checkpoint, its tokenizer and the search: text in, text out),
BLEU beside the paper's figures, translate.py's output formats and the attention the model paid."""
