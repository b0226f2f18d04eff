"""ds4: a workbench for running and tooling DeepSeek V4 locally."""

__version__ = "0.1.0"
