"""The prefix store: llama.cpp slot state files of long prompt prefixes, kept on disk.

    store       PrefixStore: lookup, pins, puts within max_bytes
    opening     open_prefix_store: the store a config describes, for the decoder's fingerprint
    statistics  StoreStatistics, the store's counts
    files       the on-disk format of an entry, the crash-safe write, the scan at open, the lock
    index       PrefixIndex: the longest stored prefix of a prompt (pure, in memory)
    sharedstore SharedPrefixStore: the store in a directory the hosts share (cache.shared_dir)
    shared      that directory's files: names per host, the listing, eviction without locks

A request meets it through supervisor/routes/stored.py; the state file's own format is
supervisor/llama/statefile.py's.
"""
