"""Moving artifacts: the copy engine between two targets and materialising layers as files.

``copy`` walks manifest → config, layers (and referrers), skips what exists and verifies every
digest; ``materialize`` writes a manifest's files at their paths in a directory, by way of
``blob_writer`` (the one verified, resumable blob writer, the node cache's too), ``untar`` (tar
layers, bounded and checked; also for the node cache and runtime assets), ``staging`` (the
locked temp entries a pull owns) and ``destination`` (what is already there: conflicts, extra
files).
"""
