"""Where records come from: perf sessions and their rings, perf.data files, record decoding, round
ordering and stream counts.
"""
