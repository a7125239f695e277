"""The disk prefix cache's state as the front ends show it: on, read-only or off, and why.

A read-only or unusable cache directory leaves the disk tier read-only or off while the
answer still comes (issue 33 item 7): ``--json`` outputs and the TUI cache panel say so,
not only a warning line on stderr.
"""

from __future__ import annotations

NOT_ENABLED = "not enabled (--no-disk-cache, or the prefix cache is off)"


def disk_reason(m) -> str | None:
    """Why the disk cache of the engine metrics ``m`` is not fully on (None when it is)."""
    warning = getattr(m, "disk_warning", None)
    if warning:
        return warning
    return NOT_ENABLED if getattr(m, "disk_state", "") in ("", "off") else None


def disk_cache_json(m) -> dict:
    """The ``disk_cache`` object of ``--json`` outputs, from engine metrics ``m``."""
    return {"state": getattr(m, "disk_state", "") or "off", "reason": disk_reason(m),
            "entries": m.disk_entries, "bytes": m.disk_bytes,
            "write_errors": m.disk_write_errors, "warning": m.disk_warning}


def disk_line(m) -> str:
    """One line for a panel: the state, then entries or why."""
    state = getattr(m, "disk_state", "") or "off"
    if state == "on":
        size = getattr(m, "disk_bytes", 0) / 2**20
        line = f"on · {getattr(m, 'disk_entries', 0)} blocks, {size:.1f} MiB"
    else:
        line = f"{state} · {disk_reason(m)}"
    errors = getattr(m, "disk_write_errors", 0)
    return line + (f" · {errors} write errors" if errors else "")
