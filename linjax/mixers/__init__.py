"""Attention mixers: softmax and its linear replacements."""
