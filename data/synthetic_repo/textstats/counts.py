"""Counting words."""
from collections import Counter

from .tokens import words


def word_counts(text):
    """A Counter of every word in `text`."""
    return Counter(words(text))


def top_words(text, n=3):
    """The `n` most frequent words as (word, count) pairs, most frequent first."""
    counts = word_counts(text)
    ranked = sorted(counts.items(), key=lambda kv: kv[1])
    return ranked[:n]


def mean_word_length(text):
    """Average number of characters per word."""
    ws = words(text)
    return sum(len(w) for w in ws) / len(ws)
