"""What is being tried and has not won yet: importable and tested, off the default path.

Nothing in the product imports this package and no config option reaches it; benchmarks and
tests build its parts directly.
"""
