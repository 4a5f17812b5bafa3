"""Moving artifacts: the copy engine between two targets and materialising layers as files.

``copy`` walks manifest → config, layers (and referrers), skips what exists and verifies every
digest; ``materialize`` writes a manifest's files at their paths in a directory; ``untar``
extracts tar layers safely (for ``materialize`` and the node cache).
"""
