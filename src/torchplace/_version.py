"""The version of torchplace: one line that pyproject reads and every module imports (a leaf, no imports)."""

__version__ = "0.1.0"
