"""Local models: the embedded default and the Hugging Face hub cache; list, download, delete.

The hub cache directory is read from the environment at call time (``HF_HUB_CACHE``,
then ``HF_HOME``/hub), as is ``HF_HUB_OFFLINE``, so a test or the user can point
kvchat elsewhere without restarting Python. Downloads report progress through a
tqdm-compatible class that calls back instead of drawing on the terminal.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from engine.errors import KVChatError, ModelLoadError

DEFAULT_MODEL = "default"
_TRUE = {"1", "ON", "YES", "TRUE"}


class HubError(KVChatError):
    """A download or delete failed; the message says why in plain words."""


@dataclass(slots=True)
class LocalModel:
    """A model on this machine, as the models screen lists it."""

    name: str  # "default" or the hub repo id
    source: str  # "embedded" or "hub"
    size_bytes: int
    path: Path | None  # the GGUF file or the hub snapshot directory
    loadable: bool = True  # hub snapshots need a config.json
    architecture: str = ""  # `architectures.summary` of its config ("" when unreadable)

    @property
    def spec(self) -> str:
        """What `engine.load_model` takes for this model."""
        return self.name if self.source == "embedded" else str(self.path)


@dataclass(slots=True)
class DownloadProgress:
    """Bytes and files of a running download (totals grow while files are listed)."""

    done_bytes: int = 0
    total_bytes: int = 0
    done_files: int = 0
    total_files: int = 0

    @property
    def fraction(self) -> float | None:
        return self.done_bytes / self.total_bytes if self.total_bytes else None


def hub_cache_dir() -> Path:
    """The hub cache: ``$HF_HUB_CACHE``, ``$HF_HOME/hub`` or huggingface_hub's default."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def hub_offline() -> bool:
    from huggingface_hub import constants

    return os.environ.get("HF_HUB_OFFLINE", "").upper() in _TRUE or bool(constants.HF_HUB_OFFLINE)


def _embedded_model() -> LocalModel | None:
    from engine.model.loader import default_gguf_path

    try:
        path = default_gguf_path()
    except ModelLoadError:
        return None
    return LocalModel(DEFAULT_MODEL, "embedded", path.stat().st_size, path,
                      architecture="llama, 30 layers")


def _architecture(config_path: Path) -> str:
    from engine.model.architectures import summary

    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError):
        return ""
    return summary(config) if isinstance(config, dict) else ""


def list_hub_models() -> list[LocalModel]:
    """Model repos in the hub cache (newest revision each), sorted by repo id."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        info = scan_cache_dir(hub_cache_dir())
    except CacheNotFound:
        return []
    out = []
    for repo in info.repos:
        if repo.repo_type != "model" or not repo.revisions:
            continue
        rev = max(repo.revisions, key=lambda r: r.last_modified)
        path = Path(rev.snapshot_path)
        out.append(LocalModel(repo.repo_id, "hub", repo.size_on_disk, path,
                              loadable=(path / "config.json").is_file(),
                              architecture=_architecture(path / "config.json")))
    return sorted(out, key=lambda m: m.name.lower())


def list_local_models() -> list[LocalModel]:
    """The embedded default (when installed) first, then the hub cache's models."""
    embedded = _embedded_model()
    return ([embedded] if embedded else []) + list_hub_models()


def resolve_spec(name: str | None) -> str | None:
    """A repo id found in our hub cache -> its snapshot directory; anything else unchanged."""
    if not name or name == DEFAULT_MODEL or "/" not in name or Path(name).exists():
        return name
    for model in list_hub_models():
        if model.name == name:
            return str(model.path)
    return name


def progress_class(on_progress: Callable[[DownloadProgress], None]) -> type:
    """A tqdm-like class for ``snapshot_download(tqdm_class=...)`` that reports, never draws.

    huggingface_hub opens one bar counting files and byte bars ("Downloading bytes",
    "Reconstructing ..."); the byte bar that is not the transfer bar counts bytes on disk.
    """
    state = DownloadProgress()
    lock = threading.Lock()

    class HubProgress:
        """Counts like a tqdm bar and reports to ``on_progress``; draws nothing."""

        def __init__(self, iterable=None, *args, total=None, initial=0, unit="it", desc="",
                     **kwargs):
            self.iterable, self.n, self.unit, self.desc = iterable, initial or 0, unit, desc or ""
            self._total = total or 0
            self._report()

        @property
        def total(self):
            return self._total

        @total.setter
        def total(self, value):
            self._total = value or 0
            self._report()

        def _report(self) -> None:
            with lock:
                if self.unit == "B":
                    if self.desc.startswith("Downloading bytes"):
                        return  # network bytes; reconstruction counts what lands on disk
                    state.done_bytes, state.total_bytes = int(self.n), int(self._total)
                else:
                    state.done_files, state.total_files = int(self.n), int(self._total)
                snapshot = DownloadProgress(state.done_bytes, state.total_bytes,
                                            state.done_files, state.total_files)
            on_progress(snapshot)

        def update(self, n=1):
            self.n += n or 0
            self._report()

        def __iter__(self):
            for item in self.iterable or ():
                yield item
                self.update(1)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.close()

        def close(self): ...
        def refresh(self, *args, **kwargs): ...
        def set_description(self, desc=None, refresh=True): ...
        def set_description_str(self, desc=None, refresh=True): ...
        def set_postfix_str(self, s="", refresh=True): ...

        @property
        def format_dict(self) -> dict:
            return {"rate": None}

    return HubProgress


def download_model(repo_id: str, *,
                   on_progress: Callable[[DownloadProgress], None] | None = None) -> Path:
    """Download a repo into the hub cache (or find it there when offline); return its path.

    Raises:
        HubError: invalid or unknown repo id, gated repo, offline, network failure.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
    from huggingface_hub.utils import validate_repo_id

    repo_id = repo_id.strip()
    try:
        validate_repo_id(repo_id)
        if "/" not in repo_id:
            raise HFValidationError("no owner")
    except HFValidationError as e:
        raise HubError(f"{repo_id!r} is not a repo id: use owner/name, "
                       "e.g. mlx-community/Qwen2.5-0.5B-Instruct-4bit") from e
    offline = hub_offline()
    kwargs = {"tqdm_class": progress_class(on_progress)} if on_progress else {}
    try:
        path = snapshot_download(repo_id, cache_dir=hub_cache_dir(), local_files_only=offline,
                                 **kwargs)
    except GatedRepoError as e:
        raise HubError(f"{repo_id} is gated: accept its terms on huggingface.co and run "
                       "`hf auth login`") from e
    except (RepositoryNotFoundError, RevisionNotFoundError) as e:
        raise HubError(f"no model {repo_id} on the Hugging Face hub (check the spelling; "
                       "private repos need `hf auth login`)") from e
    except LocalEntryNotFoundError as e:
        if offline:
            raise HubError(f"offline (HF_HUB_OFFLINE is set) and {repo_id} is not in the "
                           "local hub cache") from e
        raise HubError(f"cannot reach the Hugging Face hub (offline?) and {repo_id} is not "
                       "in the local hub cache") from e
    except OSError as e:  # disk full, permissions, connection errors surfacing as OSError
        raise HubError(f"download of {repo_id} failed: {e}") from e
    except Exception as e:  # httpx errors and other hub failures
        raise HubError(f"download of {repo_id} failed: {type(e).__name__}: {e}") from e
    return Path(path)


def delete_model(repo_id: str) -> int:
    """Delete every cached revision of a hub model; returns the bytes freed."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    if repo_id == DEFAULT_MODEL:
        raise HubError("the embedded default model ships with kvchat and cannot be deleted")
    try:
        info = scan_cache_dir(hub_cache_dir())
    except CacheNotFound as e:
        raise HubError(f"{repo_id} is not in the local hub cache") from e
    repos = [r for r in info.repos if r.repo_id == repo_id and r.repo_type == "model"]
    if not repos:
        raise HubError(f"{repo_id} is not in the local hub cache")
    # every revision goes, so the whole repo folder goes (as `hf cache delete` does)
    shutil.rmtree(repos[0].repo_path)
    return repos[0].size_on_disk
