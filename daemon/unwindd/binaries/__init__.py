"""What a binary holds: ELF reading (elf), the shared ELF cache (elfcache, elfentry) and its disk
cache files (cachefiles), compiled CFI (cfi), symbol tables (symtab, elfsyms, symstore), kernel
and JIT symbols (kallsyms, perfmaps), names for frames (symbolize), demangling (demangle).
"""
