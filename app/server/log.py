"""`kvchat serve`'s own lines on stderr: start-up, draining, key reloads, the final check.

Its own module because the command (`app.server.command`) and the uvicorn runner
(`app.server.runner`) both write them, in the same form.
"""

from __future__ import annotations

import sys


def log(message: str) -> None:
    """One ``kvchat serve: ...`` line on stderr, flushed at once (a supervisor reads it live)."""
    print(f"kvchat serve: {message}", file=sys.stderr, flush=True)
