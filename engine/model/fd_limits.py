"""mlx-lm's import-time open-file limit, made harmless.

``mlx_lm.utils`` runs ``resource.setrlimit(RLIMIT_NOFILE, (2048, 4096))`` when imported: it
*lowers* a larger hard limit to 4,096 for the whole process (a server then cannot hold more
connections than that), and under a hard limit below 4,096 it raises ``ValueError``, so
every command, even ``cache stats``, died at import with a traceback. kvchat imports it once
here with that call skipped, then raises the soft limit towards 2,048 (what mlx-lm wanted:
many weight shards open at once) as far as the hard limit allows.
"""

from __future__ import annotations

import contextlib
import resource

WANTED_SOFT = 2048


def import_mlx_lm() -> None:
    """Import ``mlx_lm.utils`` keeping the process's own open-file limits."""
    real = resource.setrlimit

    def keep_nofile(which, limits):
        if which != resource.RLIMIT_NOFILE:
            real(which, limits)

    resource.setrlimit = keep_nofile
    try:
        import mlx_lm.utils  # noqa: F401
    finally:
        resource.setrlimit = real
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = WANTED_SOFT if hard == resource.RLIM_INFINITY else min(WANTED_SOFT, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        with contextlib.suppress(ValueError, OSError):  # a sandbox that refuses: keep it
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
