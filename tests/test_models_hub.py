"""The local model list, delete, download errors and progress (settings: test_settings.py).

No network: the hub cache is a temp dir laid out as huggingface_hub lays it out, and
downloads run with HF_HUB_OFFLINE=1 or fail validation before any request.
"""

from __future__ import annotations

import hashlib

import pytest

from app import models_hub
from app.models_hub import DownloadProgress, HubError


def add_hub_repo(cache, repo_id: str, files: dict[str, bytes], commit: str = "a" * 40):
    """Lay out one model repo exactly as huggingface_hub does: blobs, refs, snapshot symlinks."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snap / name).symlink_to(f"../../blobs/{blob.name}")
    return snap


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


def test_lists_embedded_default_then_hub_models(hub_cache):
    add_hub_repo(hub_cache, "org/tiny-llama", {"config.json": b'{"model_type": "llama"}',
                                              "model.safetensors": b"x" * 1000})
    add_hub_repo(hub_cache, "org/no-config", {"README.md": b"hi"})
    models = models_hub.list_local_models()
    assert [m.name for m in models] == ["default", "org/no-config", "org/tiny-llama"]
    default, no_config, tiny = models
    assert default.source == "embedded" and default.spec == "default" and default.size_bytes > 0
    assert tiny.source == "hub" and tiny.loadable and tiny.size_bytes >= 1000
    assert tiny.spec == str(tiny.path) and (tiny.path / "config.json").is_file()
    assert not no_config.loadable
    assert models_hub.resolve_spec("org/tiny-llama") == str(tiny.path)
    assert models_hub.resolve_spec("org/unknown") == "org/unknown"
    assert models_hub.resolve_spec(None) is None


def test_empty_or_missing_cache_lists_only_default(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "nowhere"))
    assert [m.name for m in models_hub.list_local_models()] == ["default"]


def test_delete_removes_the_repo(hub_cache):
    add_hub_repo(hub_cache, "org/a", {"config.json": b"{}", "w.bin": b"y" * 500})
    add_hub_repo(hub_cache, "org/b", {"config.json": b"{}"})
    freed = models_hub.delete_model("org/a")
    assert freed >= 500
    assert [m.name for m in models_hub.list_hub_models()] == ["org/b"]
    assert not (hub_cache / "models--org--a").exists()
    with pytest.raises(HubError, match="not in the local hub cache"):
        models_hub.delete_model("org/a")
    with pytest.raises(HubError, match="cannot be deleted"):
        models_hub.delete_model("default")


def test_download_offline_unknown_repo_says_offline(hub_cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubError, match="offline .*org/does-not-exist is not in the local hub"):
        models_hub.download_model("org/does-not-exist")


def test_download_offline_finds_a_cached_repo(hub_cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    snap = add_hub_repo(hub_cache, "org/cached", {"config.json": b"{}"})
    assert models_hub.download_model("org/cached") == snap


@pytest.mark.parametrize("bad", ["", "no owner", "../etc", "a/b/c", "justaname"])
def test_download_rejects_invalid_repo_ids(hub_cache, bad):
    with pytest.raises(HubError, match="is not a repo id"):
        models_hub.download_model(bad)


def test_download_maps_unknown_repo_to_a_clear_message(hub_cache, monkeypatch):
    from huggingface_hub.errors import RepositoryNotFoundError

    http = pytest.importorskip("httpx2")  # huggingface_hub's HTTP client

    def not_found(repo_id, **kwargs):
        response = http.Response(404, request=http.Request("GET", "https://huggingface.co"))
        raise RepositoryNotFoundError("404", response=response)

    monkeypatch.setattr("huggingface_hub.snapshot_download", not_found)
    with pytest.raises(HubError, match="no model org/nope on the Hugging Face hub"):
        models_hub.download_model("org/nope")


def test_progress_class_reports_bytes_and_files():
    seen: list[DownloadProgress] = []
    cls = models_hub.progress_class(seen.append)
    files = cls(total=2, desc="Fetching 2 files")
    transfer = cls(total=0, unit="B", desc="Downloading bytes")
    disk = cls(total=0, unit="B", desc="Reconstructing (incomplete total...)")
    disk.total = 300
    transfer.update(50)  # network bytes are not what the bar shows
    disk.update(100)
    files.update(1)
    assert seen[-1] == DownloadProgress(100, 300, 1, 2)
    assert seen[-1].fraction == pytest.approx(1 / 3)
    with disk:
        disk.set_postfix_str("x")
        disk.update(200)
    assert seen[-1].done_bytes == 300
    assert list(cls(iterable=[1, 2], total=2)) == [1, 2]
