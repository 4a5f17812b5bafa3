"""KServe: the ``ClusterStorageContainer`` storage initializer and the objects that use it.

``uri`` parses the storage URIs an InferenceService or LocalModelCache names, ``settings`` reads
the container's environment (what KServe's webhook and LocalModelNode agent set, plus the
``MODELPACK_*`` settings the ClusterStorageContainer adds), ``initializer`` puts verified files
at each destination (through the node cache when one is mounted, ``placement`` links them into
the destination), ``progress_lines`` reports the transfer as plain log lines, and ``manifests``
builds the ClusterStorageContainers, InferenceService, LocalModelCache and LocalModelNodeGroup.
"""
