"""An answer's text on stdout as its events stream in (`kvchat generate` and `kvchat ask`)."""

from __future__ import annotations

import sys


def echo_events(events, *, show: bool):
    """Pass ``events`` through, writing their text to stdout as it streams when ``show``."""
    for event in events:
        if show:
            sys.stdout.write(event.text)
            sys.stdout.flush()
        yield event
    if show:
        sys.stdout.write("\n")
