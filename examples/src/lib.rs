//! Examples of the KV-cache server: pipelines, a third-party backend, the trace replay client.
