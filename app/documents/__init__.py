"""Documents for offline Q&A: loading, chunks, retrieval, the context budget policy, and
the named sessions that keep a document's cached prefix between runs."""
