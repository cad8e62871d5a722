"""Split text into words."""
import re

_WORD = re.compile(r"[a-z']+")


def words(text):
    """Lower-cased words of `text`, in order. Apostrophes stay inside words."""
    return [w.strip("'") for w in _WORD.findall(text.lower()) if w.strip("'")]
