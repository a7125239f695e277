"""The app's settings: this chat's generation settings and the app-wide KV cache format (F6).

The sampling an answer uses is layered: the built-in defaults, then the saved defaults,
then ``--max-tokens``/``--temp`` when typed on the command line (they win for their run,
as the KV flags do; None when not typed), then the chat's own settings.
"""

from __future__ import annotations

import contextlib

from textual.app import App

from app import settings
from app.engine_like import EngineLike
from app.settings import GenerationSettings
from app.tui.screens.settings import SettingsChoice, SettingsScreen
from engine import SamplingParams


def describe_generation(g: GenerationSettings) -> str:
    """One line: "temperature 0.7 · top-p 0.9 · max 512 tokens · repetition penalty 1.1"."""
    parts = [f"temperature {g.temperature:g}"]
    if 0 < g.top_p < 1:  # 0 and 1 both keep every token: off
        parts.append(f"top-p {g.top_p:g}")
    else:
        parts.append("top-p off")
    parts.append(f"max {g.max_tokens:,} tokens")
    if g.repetition_penalty != 1.0:
        parts.append(f"repetition penalty {g.repetition_penalty:g}")
    return " · ".join(parts)


class SettingsHost(App):
    """Settings of `ChatApp` (which provides the members declared here)."""

    engine: EngineLike | None
    kv_cache: str | None
    max_tokens: int | None  # typed on the command line; None: not given
    temperature: float | None
    remember: bool
    model_loading: bool
    model_name: str | None
    loading_spec: str | None
    saved_generation: dict | None = None  # the saved defaults, read at start

    def generation_defaults(self) -> GenerationSettings:
        """The defaults for a chat without settings of its own (see the module's layers)."""
        cli = {"max_tokens": self.max_tokens, "temperature": self.temperature}
        return GenerationSettings.from_dict(
            {k: v for k, v in cli.items() if v is not None},
            GenerationSettings.from_dict(self.saved_generation))

    def chat_generation(self) -> GenerationSettings:
        """The settings the chat on screen answers with (the defaults before it is up)."""
        installed = self.is_screen_installed("chat")
        own = self.chat.conversation.params if installed else {}  # type: ignore[attr-defined]
        return GenerationSettings.from_dict(own, self.generation_defaults())

    def sampling(self) -> SamplingParams:
        g = self.chat_generation()
        return SamplingParams(max_tokens=g.max_tokens, temperature=g.temperature,
                              top_p=g.top_p, repetition_penalty=(
                                  None if g.repetition_penalty == 1.0 else g.repetition_penalty))

    def action_settings(self) -> None:
        if isinstance(self.screen, SettingsScreen):
            return
        in_use = self.engine.metrics().kv_format if self.engine is not None else ""
        self.push_screen(SettingsScreen(self.kv_cache, in_use, self.chat_generation()),
                         self.apply_settings)

    def apply_settings(self, choice: SettingsChoice | None) -> None:
        """Apply what F6 chose: the chat's generation settings, then the KV format."""
        if choice is None:
            return
        chat = self.chat  # type: ignore[attr-defined]
        if choice.as_default:
            self.saved_generation = choice.generation.to_dict()
            if self.remember:
                with contextlib.suppress(OSError):
                    settings.save_settings(generation=self.saved_generation)
            chat.conversation.params = {}  # the chat follows the defaults
        else:
            chat.conversation.params = choice.generation.changes(self.generation_defaults())
        where = "the defaults" if choice.as_default else "this chat"
        self.notify(f"Generation for {where}: {describe_generation(choice.generation)}.",
                    timeout=4)
        chat.save()
        chat.update_status()
        self.set_kv_cache(choice.kv_cache)

    def set_kv_cache(self, name: str | None) -> None:
        """Use the KV cache format ``name`` from now on: save it, reload the model in it.

        The reload goes the model-switch way (new engine in, old one shut down), so the
        chat is kept; it waits for an answer being written, which it would cut short.
        """
        if name is None or name == (self.kv_cache or "float"):
            return
        if not self._idle("changing the KV cache"):  # type: ignore[attr-defined]
            return
        self.kv_cache = name
        if self.remember:
            try:
                settings.save_settings(kv_cache=name)
            except OSError as e:  # still used for this run
                self.notify(f"Could not save the setting: {e}", severity="warning", timeout=4)
        if self.engine is None and not self.model_loading:
            self.notify(f"KV cache {name}: it applies when a model loads (F3).")
            return
        spec = self.loading_spec if self.model_loading else self.model_name
        self.notify(f"KV cache {name}: reloading the model.", timeout=3)
        self.load_model(spec)  # type: ignore[attr-defined]
