"""Word statistics for plain text."""
from .counts import mean_word_length, top_words, word_counts
from .tokens import words

__all__ = ["words", "word_counts", "top_words", "mean_word_length"]
