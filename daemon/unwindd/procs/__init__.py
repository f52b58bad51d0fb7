"""Who maps what: the process table built from side-band records, /proc, and the live table's
rescans and caps.
"""
