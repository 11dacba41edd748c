from engine.spec_decode.ngram import propose_ngram


def test_proposes_what_followed_the_most_recent_match_of_the_longest_suffix():
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 4, 6, 7, 2, 3, 4]
    assert propose_ngram(tokens, 3, 1, 3) == [6, 7, 2]  # [2, 3, 4] last seen before 6, 7, 2
    assert propose_ngram(tokens, 10, 1, 3) == [6, 7, 2, 3, 4]


def test_falls_back_to_shorter_suffixes_and_gives_up_without_a_match():
    assert propose_ngram([5, 1, 2, 8, 9, 2], 2, 1, 3) == [8, 9]
    assert propose_ngram([5, 1, 2, 8, 9, 7], 2, 1, 3) == []
    assert propose_ngram([5, 1, 2, 8, 9, 2], 2, 2, 3) == []
    assert propose_ngram([3], 4, 1, 2) == []
