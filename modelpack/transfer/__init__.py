"""Moving artifacts: the copy engine between two targets and materialising layers as files.

``copy`` walks manifest → config, layers (and referrers), skips what exists and verifies every
digest; ``materialize`` writes a manifest's files at their paths in a directory.
"""
