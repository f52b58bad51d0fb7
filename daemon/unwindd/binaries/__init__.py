"""What a binary holds: ELF reading, the shared ELF cache and its disk cache, compiled CFI, symbol
tables, demangling.
"""
