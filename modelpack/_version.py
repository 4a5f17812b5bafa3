"""The version of modelpack: the one place it is written.

pyproject.toml reads it (``[tool.setuptools.dynamic]``), ``modelpack.__version__`` and
``modelpack --version`` print it, and CHANGELOG.md's newest release heading must name it
(tests/core/test_version.py). A release changes this line and that heading together.
"""

__version__ = "0.1.0"
