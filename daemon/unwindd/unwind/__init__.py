"""From a sample and its address space to named frames: the native unwinder and the engine that
places, unwinds and names.
"""
