"""The stages joined: the live profiler and its native step (rings), and the native replay (files).
"""
