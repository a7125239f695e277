"""kvchat's user-facing side: the Textual TUI chat, the CLI (generate, ask, cache, ...),
benchmarks, evals and the OpenAI-compatible HTTP server. Imports engine, never the reverse."""
