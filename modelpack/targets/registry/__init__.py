"""OCI distribution: ``client`` (HTTP, retries, typed errors), ``auth`` (credentials, Basic/Bearer
challenges, token cache), ``target`` (``RegistryTarget``, the Target protocol over one repository),
``errors``. Open a target with ``modelpack.targets.open_target("host/repo:tag")``."""
