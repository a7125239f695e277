"""kvchat's user-facing side: CLI (and later the Textual TUI). Imports engine, never the reverse."""
