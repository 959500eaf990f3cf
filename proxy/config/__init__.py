"""The operator's config: pydantic models (frozen, ``extra="forbid"``), loading with key paths in
every error, cross-references and the files a config names (``refs``), TLS material (``tls``)."""
