"""The disk cache's state, on / read-only / off and why, wherever the cache is shown
(issue 33 item 7): a read-only or unusable cache directory used to show only in one
stderr warning line, while ``--json`` said nothing of it and the TUI panel nothing at all.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
from rich.console import Console
from test_tui_fakes import fake_metrics

from app.disk_state import NOT_ENABLED
from app.tui.widgets.cache_panel import metrics_table
from engine.kvcache.disk.store import DiskPrefixStore


def loose_dir(tmp_path):
    """A directory others may write into: kvchat reads nothing from it (off)."""
    path = tmp_path / "loose"
    path.mkdir()
    os.chmod(path, 0o777)
    return path


def panel(m) -> str:
    console = Console(width=60, record=True)
    console.print(metrics_table(m, None))
    return " ".join(console.export_text().split())


def test_the_store_says_on_read_only_or_off(tmp_path):
    good = tmp_path / "good"
    assert DiskPrefixStore(good).state == "on"
    link = tmp_path / "link"
    os.symlink(good, link)
    linked = DiskPrefixStore(link)
    assert linked.state == "read-only" and "symlink" in linked.degraded
    off = DiskPrefixStore(loose_dir(tmp_path))
    assert off.state == "off" and "not private" in off.degraded


@pytest.mark.parametrize("state,warning,shown", [
    ("on", None, "disk on · 3 blocks, 1.0 MiB"),
    ("read-only", "disk cache read-only: /h/prefix is not writable",
     "disk read-only · disk cache read-only: /h/prefix is not writable"),
    ("off", "disk cache off: cannot use /h/prefix: Read-only file system",
     "disk off · disk cache off: cannot use /h/prefix: Read-only file system"),
    ("off", None, f"disk off · {NOT_ENABLED}"),
])
def test_the_cache_panel_shows_the_state_and_why(state, warning, shown):
    m = dataclasses.replace(fake_metrics(), disk_state=state, disk_warning=warning,
                            disk_entries=3, disk_bytes=1 << 20)
    assert shown in panel(m)


def test_a_panel_of_metrics_without_a_state_adds_no_row():
    assert "disk" not in panel(fake_metrics())  # fakes, and engines before this field


def generate_json(kvchat_cli, *args) -> dict:
    code, out, err = kvchat_cli("generate", "--json", "--prompt", "Hi", "--max-tokens", "2",
                                *args)
    assert code == 0, err
    return json.loads(out)


def test_generate_json_says_the_disk_cache_state(tmp_path, kvchat_cli):
    store = tmp_path / "prefix"
    on = generate_json(kvchat_cli, "--cache-dir", str(store))["disk_cache"]
    assert on["state"] == "on" and on["reason"] is None
    link = tmp_path / "link"
    os.symlink(store, link)  # a directory kvchat only reads from
    ro = generate_json(kvchat_cli, "--cache-dir", str(link))
    assert ro["disk_cache"]["state"] == "read-only" and "symlink" in ro["disk_cache"]["reason"]
    assert ro["cache_source"] == "disk"  # still served from it
    off = generate_json(kvchat_cli, "--cache-dir", str(loose_dir(tmp_path)))["disk_cache"]
    assert off["state"] == "off" and "not private" in off["reason"]
    none = generate_json(kvchat_cli, "--no-disk-cache")["disk_cache"]
    assert none == {**none, "state": "off", "reason": NOT_ENABLED}


def test_ask_and_cache_stats_json_say_it_too(tmp_path, kvchat_cli):
    doc = tmp_path / "doc.txt"
    doc.write_text("The blue door's code is 4417. The red door has none.")
    loose = str(loose_dir(tmp_path))
    code, out, err = kvchat_cli("ask", "--doc", str(doc), "What is the code?", "--json",
                                "--max-tokens", "4", "--cache-dir", loose)
    assert code == 0, err
    disk = json.loads(out.splitlines()[-1])["disk_cache"]
    assert disk["state"] == "off" and "not private" in disk["reason"]
    code, out, err = kvchat_cli("cache", "stats", "--json", "--cache-dir", loose)
    assert json.loads(out)["state"] == "off"


def test_the_server_metrics_say_it():
    from app.server.metrics_export import _disk

    m = dataclasses.replace(fake_metrics(), disk_state="read-only",
                            disk_warning="disk cache read-only: /h/prefix is not writable")
    (info,) = [f for f in _disk(m) if f.name == "kvchat_disk_cache"]
    assert info.samples[0].labels == {"state": "read-only",
                                      "reason": "disk cache read-only: /h/prefix is not writable"}
