"""Bug-injection benchmark generator: real PyPI packages, one AST mutation per instance."""
