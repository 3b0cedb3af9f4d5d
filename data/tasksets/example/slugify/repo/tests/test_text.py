import unittest

from text import slugify


class TestSlugify(unittest.TestCase):
    def test_lower(self):
        self.assertEqual(slugify("Hello World"), "hello-world")

    def test_spaces(self):
        self.assertEqual(slugify("  a   b "), "a-b")
