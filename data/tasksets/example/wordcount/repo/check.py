from words import count_words

assert count_words("a b  c") == 3, count_words("a b  c")
assert count_words("") == 0, count_words("")
assert count_words("one") == 1
print("ok")
