"""The stages joined: the live profiler and its native step (rings), the native replay (files),
the Python replay for what the native one does not take, and the command line's text outputs.
"""
