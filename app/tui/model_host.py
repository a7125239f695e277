"""The app's engine: load a model in a thread worker, install it, and stop it cleanly.

The engine is built in a thread worker (``engine_factory(spec, kv_cache=...)``), so the
UI never waits for a model to load; a switch installs the new engine, then shuts the old
one down, which cancels its requests and gives its KV pool back.

Quitting waits for every thread that may be running MLX work (a model load, an answer
being written) and joins the engine's thread before the app exits: a native thread still
inside MLX while the interpreter tears down ends the process with "terminate called
without an active exception" instead of exit status 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from textual import work
from textual.app import App
from textual.reactive import reactive
from textual.worker import get_current_worker

from app import models_hub, settings
from app.engine_like import EngineLike
from app.tui.engine_factory import EngineFactory
from app.tui.widgets.cache_panel import short_format
from engine.errors import KVChatError

# the thread workers that may be inside MLX when the user quits
MLX_GROUPS = ("model", "generation")
BUILDING = "building kvchat's CPU extension (first run only)"
QUIT_WAIT_S = 120.0  # the longest quit waits for a model load still running in a thread


def model_name(spec: str | None) -> str:
    """The model's own name (chats, exports): the embedded default's file name, a path's
    last part, a repo id."""
    if not spec or spec == models_hub.DEFAULT_MODEL:
        from engine.model.loader import DEFAULT_GGUF_FILE

        return DEFAULT_GGUF_FILE.split(".")[0]
    return Path(spec).name if Path(spec).exists() else spec


def model_label(spec: str | None) -> str:
    """The model's name for the status line and F3, the default marked as such."""
    default = not spec or spec == models_hub.DEFAULT_MODEL
    return model_name(spec) + (" (default)" if default else "")


class LoadThreads:
    """Counts the threads loading a model. A load replaced by another (its worker
    cancelled, so Textual counts it finished) goes on in its thread: quit waits for it."""

    def __init__(self):
        self._done = threading.Condition()
        self._running = 0

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        with self._done:
            self._running += 1
        try:
            yield
        finally:
            with self._done:
                self._running -= 1
                self._done.notify_all()

    def wait(self, timeout: float) -> bool:
        """Block until no load runs (False: still one after ``timeout`` seconds)."""
        with self._done:
            return self._done.wait_for(lambda: self._running == 0, timeout)


def finish_mlx_work() -> None:
    """Wait for MLX's queued work (arrays still being computed) to finish."""
    with contextlib.suppress(Exception):  # no MLX, or nothing to wait for
        import mlx.core as mx

        mx.synchronize()


class ModelHost(App):
    """The engine side of `ChatApp`: loading, switching and shutting engines down."""

    model_status: reactive[str] = reactive("")
    """What the status line says about the model (loading, ready, failed)."""
    model_loading: reactive[bool] = reactive(False)

    engine_factory: EngineFactory
    engine: EngineLike | None
    model_name: str | None
    loading_spec: str | None
    remember: bool
    closing: bool = False  # set when quitting: a load that ends now is shut down, not installed
    load_threads: LoadThreads

    def load_model(self, spec: str | None, *, fallback: bool = False) -> None:
        """Load a model in a worker; ``fallback``: on failure, load the default instead."""
        name = spec or models_hub.DEFAULT_MODEL
        self.model_loading = True
        self.loading_spec = spec
        self.model_status = f"loading model {model_label(name)}…"
        self._load_worker(spec, fallback, getattr(self, "kv_cache", None))

    @work(thread=True, exclusive=True, group="model", exit_on_error=False)
    def _load_worker(self, spec: str | None, fallback: bool, kv_cache: str | None) -> None:
        with self.load_threads.running():
            self._load(get_current_worker(), spec, fallback, kv_cache)

    def _load(self, worker, spec: str | None, fallback: bool, kv_cache: str | None) -> None:
        from engine.model.cpu_ext.build import build_pending

        if build_pending():  # the first launch on this machine compiles it: say why it waits
            self.call_from_thread(self._start_build_clock)
        try:
            engine = self.engine_factory(spec, kv_cache=kv_cache)
            engine.start()
        except Exception as e:  # ModelLoadError, a bad directory, out of memory...
            if self.closing:
                return
            text = str(e) if isinstance(e, KVChatError | ValueError | OSError) else repr(e)
            self.call_from_thread(self._load_failed, spec, text, fallback)
            return
        if worker.is_cancelled or self.closing:  # another load started, or the app quits
            engine.shutdown()
            return
        try:
            old = self.call_from_thread(self._install_engine, engine, spec)
        except RuntimeError:  # the app stopped meanwhile: nobody will shut it down but us
            old = engine
        if old is not None:
            # the one replaced (its requests cancelled, its pool released), or this one
            # when the app began to quit meanwhile: its thread must not outlive the app
            old.shutdown()

    def _start_build_clock(self) -> None:
        """Say how far the CPU extension's build is (files compiled, when this process
        builds it) and how long it has taken so far (~20 s to minutes)."""
        from engine.model.cpu_ext import build

        started = time.monotonic()

        def tick() -> None:
            if not self.model_loading or not self.model_status.startswith(BUILDING):
                clock.stop()  # the load ended (or another began): the status moved on
                return
            steps = (f"{build.build_progress[0]}/{build.build_progress[1]} steps, "
                     if build.build_progress else "")
            self.model_status = (f"{BUILDING}: {steps}"
                                 f"{time.monotonic() - started:.0f} s so far…")

        self.model_status = f"{BUILDING}: 0 s so far…"
        clock = self.set_interval(1.0, tick)

    def _install_engine(self, engine: EngineLike, spec: str | None) -> EngineLike | None:
        if self.closing:
            return engine  # the loader shuts it down (not installed: `old is engine`)
        old, self.engine = self.engine, engine
        old_name, self.model_name = self.model_name, spec or models_hub.DEFAULT_MODEL
        self.model_loading = False
        self.model_status = self.describe_model()
        if self.remember:
            with contextlib.suppress(OSError):
                settings.remember_model(self.model_name)
        for notice in getattr(engine, "notices", ()):  # e.g. a KV format that fell back
            self.notify(notice, title="Note", timeout=10)
        if old is not None:
            done = "Reloaded" if old_name == self.model_name else "Switched to"
            self.notify(f"{done} {model_label(self.model_name)}.", timeout=3)
        self.on_engine_installed()
        return None if old is engine else old

    def on_engine_installed(self) -> None:
        """Hook: a new engine is in (the chat's panel resets its last-turn line)."""

    def describe_model(self) -> str:
        """The status line's model part: its name, weight format and KV cache format."""
        if self.engine is None:
            return ""
        parts = [model_label(self.model_name)]
        loaded = getattr(self.engine, "loaded", None)
        fmt = getattr(loaded, "weight_format", "")
        if fmt:  # int8 activations (`--activations int8`) trade precision: said here
            int8 = "int8-x" in getattr(loaded, "matmul", "")
            parts.append(f"weights {fmt}" + (" (int8 activations)" if int8 else ""))
        with contextlib.suppress(Exception):  # a fake or a stopped engine
            kv = self.engine.metrics().kv_format
            if kv:
                parts.append(f"KV {short_format(kv)}")
        return " · ".join(parts)

    def _load_failed(self, spec: str | None, error: str, fallback: bool) -> None:
        self.notify(error, title=f"Cannot load {spec or 'the default model'}",
                    severity="error", timeout=10)
        if fallback and spec is not None:
            self.load_model(None)
            return
        self.model_loading = False
        self.model_status = (self.describe_model() if self.engine is not None
                             else "no model loaded — F3 picks one")

    async def stop_engine(self) -> None:
        """Shut the engine down (its thread joined) off the UI thread."""
        engine, self.engine = self.engine, None
        if engine is not None:
            await asyncio.to_thread(engine.shutdown)

    async def finish_work(self) -> None:
        """Before exiting: stop the engine and wait for the workers that may run MLX code.

        The engine goes first, so an answer being written ends ("shutdown") and its worker
        returns; a model load cannot be interrupted and is waited for, then shut down.
        """
        self.closing = True
        self.model_loading = False  # the spinner stops: nothing new will be installed
        await self.stop_engine()
        for worker in list(self.workers):
            if worker.group in MLX_GROUPS and not worker.is_finished:
                with contextlib.suppress(Exception):  # its failure was reported already
                    await worker.wait()
        await asyncio.to_thread(self.load_threads.wait, QUIT_WAIT_S)
        await asyncio.to_thread(finish_mlx_work)

    def on_unmount(self) -> None:
        if self.engine is not None:  # an exit that did not go through quit
            self.closing = True
            self.engine.shutdown()
            self.engine = None
