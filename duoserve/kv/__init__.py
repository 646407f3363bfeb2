"""Moving KV between engines: the wire format, re-blocking between paged caches."""
