"""OCI distribution: ``hosts`` (which hosts are loopback), ``client`` (HTTP, retries, typed
errors), ``auth`` (credentials, Basic/Bearer challenges, token cache), ``repository`` (one
repository's paths, scopes and counters), ``blob_reads``, ``multi_range_reads`` (many ranges of one blob), ``upload`` (single PUT or resumable
chunks) and ``manifests`` (reads, pushes, referrers), joined by ``target`` (``RegistryTarget``,
the Target protocol over one repository). Open a target with
``modelpack.targets.open_target("host/repo:tag")``."""
