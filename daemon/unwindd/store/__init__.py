"""Where stacks go: the bounded stack store and the pprof encoding.
"""
