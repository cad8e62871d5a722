from textstats import mean_word_length, top_words, word_counts


def test_word_counts_ignores_case():
    assert word_counts("The cat the CAT")["the"] == 2


def test_top_words_most_frequent_first():
    assert top_words("b a b c b a", 2) == [("b", 3), ("a", 2)]


def test_top_words_ties_alphabetical():
    assert top_words("pear fig pear fig kiwi", 2) == [("fig", 2), ("pear", 2)]


def test_mean_word_length():
    assert mean_word_length("ab abcd") == 3.0


def test_mean_word_length_empty():
    assert mean_word_length("  ... 42 ") == 0.0
