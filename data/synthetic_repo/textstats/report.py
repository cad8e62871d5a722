"""Format a short plain-text report."""
from .counts import mean_word_length, top_words, word_counts


def report(text, top=3):
    """A few lines: total words, distinct words, mean length, the top words."""
    counts = word_counts(text)
    lines = [
        f"words: {sum(counts.values())}",
        f"distinct: {len(counts)}",
        f"mean length: {mean_word_length(text):.2f}",
    ]
    for word, count in top_words(text, top):
        lines.append(f"  {word}: {count}")
    return "\n".join(lines)
