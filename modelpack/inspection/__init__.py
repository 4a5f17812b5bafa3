"""Read-only questions about a registry: what is there and who signed it (``audit``), what changed
between two versions (``diff``)."""
