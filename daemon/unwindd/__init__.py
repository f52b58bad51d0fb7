"""unwindd: a long-running Linux profiling daemon that unwinds stacks live."""

__version__ = "0.1.0"
