import unittest

from fizz import fizzbuzz


class TestFizzBuzz(unittest.TestCase):
    def test_rules_file(self):
        with open("rules.txt") as f:
            self.assertIn("Fizz", f.read())

    def test_values(self):
        self.assertEqual(fizzbuzz(3), "Fizz")
        self.assertEqual(fizzbuzz(10), "Buzz")
        self.assertEqual(fizzbuzz(15), "FizzBuzz")
        self.assertEqual(fizzbuzz(7), "7")
