"""The prefix store: llama.cpp slot state files of long prompt prefixes, kept on disk.

    store       PrefixStore: bookkeeping over a directory: lookup, pins, puts within max_bytes, counts
    ledger      Ledger: the entries it holds, their LRU order, index, pins and bytes (pure)
    directory   Directory: the store's I/O as one Protocol, and the Listing it returns
    private     PrivateDirectory: cache.dir, locked
    shareddir   SharedDirectory: cache.shared_dir, which other hosts use too
    fallback    FallbackDirectory: a shared directory and the private one for while it is lost
    opening     open_prefix_store: the store a config describes (None where it is off)
    statistics  StoreStatistics, the store's counts
    files       the on-disk format of an entry, the crash-safe write, the scan at open, the lock
    index       PrefixIndex: the longest stored prefix of a prompt (pure, in memory)
    shared      a shared directory's files: names per host, the listing, eviction without locks

design.md beside this file says which concern lives where.

A request meets it through supervisor/routes/stored.py; the state file's own format is
supervisor/llama/statefile.py's.
"""
