"""Documents for offline Q&A: loading, chunks, retrieval, the context budget policy."""
