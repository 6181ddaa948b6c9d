"""headsearch: find better attention-head architectures for transformers.

Importing the package is cheap; torch is imported by the submodules that need it.
"""

__version__ = "0.1.0"
