"""A fast path's process-wide off switch: tripped once, with its reason, said once.

A kernel or an extension that fails on a user's machine (another OS, compiler or MLX
version) must cost speed, not generation: the caller takes the reference path from then
on. The first reason wins; later trips are silent.
"""

from __future__ import annotations

import logging
import threading
import warnings


class FallbackSwitch:
    """Off for the rest of the process once `trip` is called; `reason` says why."""

    def __init__(self, logger: str, message: str):
        self._log = logging.getLogger(logger)
        self._message = message  # the user's line, the reason follows it
        self._lock = threading.Lock()
        self._reason: str | None = None

    @property
    def reason(self) -> str | None:
        """Why the path is off; None while it is on."""
        return self._reason

    @property
    def tripped(self) -> bool:
        return self._reason is not None

    def trip(self, reason: str) -> bool:
        """Turn the path off; warns (one line on stderr) and logs the first time only.
        Returns whether this call tripped it."""
        with self._lock:
            if self._reason is not None:
                return False
            self._reason = reason
        line = f"{self._message}: {reason}"
        self._log.info(line)  # the warning below is the one line users see
        # One line on stderr (no source line under it): the message says everything.
        warnings.warn_explicit(line, RuntimeWarning, "kvchat", 0)
        return True

    def reset(self) -> None:
        """On again (tests; a new build in the same process)."""
        with self._lock:
            self._reason = None
