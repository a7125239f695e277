"""Settings (F6): this chat's generation settings, and the app-wide KV cache format.

The generation settings are saved with the chat (or, ticked, as the defaults for new
chats); the KV cache format is saved with the other settings and applied by a reload.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, RadioButton, RadioSet, Static

from app.settings import (
    KV_CACHE_FORMATS,
    KV_COSTLY_PCT,
    KV_KIVI,
    KV_MEASURED_COST,
    GenerationSettings,
)
from app.tui.widgets.cache_panel import short_format
from app.tui.widgets.generation_form import GenerationForm
from engine import EngineConfig
from engine.kvcache.kv_cache import KVLayout
from engine.kvcache.quant import QuantSpec

HELP = ("Apply reloads the model in the new format: the chat is kept, cached prompt prefixes "
        "are not. The choice is saved for later runs; --kv-bits, --k-bits and --v-bits on "
        "the command line override it for their run. The -kivi formats keep each sequence's "
        "newest block in fp16 and quantize a block once it fills: the most quality per byte, "
        "as fast as fp16 (README), without context shift or speculative decoding.")


def share_of_fp16(k_bits: int | None, v_bits: int | None, *, kivi: bool = False) -> float:
    """Bytes of a quantized K/V pair against float16, from the pool's own accounting.

    One group's row stands for any head dim the group divides (the engine requires that).
    """
    config = EngineConfig()
    group = config.kv_group_size
    if kivi:  # per-channel keys: a block's scales spread over its rows (`KVLayout`)
        k, v = (QuantSpec(b, group) for b in (k_bits, v_bits))
        layout = KVLayout(1, 1, group, config.block_size, mx.float16, k, v, residual=True,
                          key_channel=True)
        return layout.bytes_per_token / (2 * 2 * group)
    rows = [QuantSpec(b, group).bytes_per_row(group) if b else 2 * group
            for b in (k_bits, v_bits)]
    return sum(rows) / (2 * 2 * group)


def describe(name: str) -> str:
    """One option's label, e.g. "q8 — 8-bit K and V · 53% of fp16's bytes"."""
    k, v = KV_CACHE_FORMATS[name]
    if k is None and v is None:
        return f"{name} — unquantized, in the model's float dtype (default)"
    sides = f"{k}-bit K and V" if k == v else f"{k or 16}-bit K, {v or 16}-bit V"
    kivi = name in KV_KIVI
    if kivi:
        sides += ", K per channel"  # and the newest block fp16 (the help says so)
    label = f"{name} — {sides} · {100 * share_of_fp16(k, v, kivi=kivi):.0f}% of fp16's bytes"
    cost = KV_MEASURED_COST.get(name)
    if cost is not None:
        label += f" · {cost:+.1f}% perplexity" + (": costly" if cost > KV_COSTLY_PCT else "")
    return label


@dataclass(frozen=True, slots=True)
class SettingsChoice:
    """What Apply chose: the KV format (a `KV_CACHE_FORMATS` key) and this chat's sampling."""

    kv_cache: str
    generation: GenerationSettings
    as_default: bool = False  # the generation settings become the defaults for new chats


class SettingsScreen(ModalScreen[SettingsChoice | None]):
    """Choose the KV cache format and the chat's generation settings; dismisses with a
    `SettingsChoice`, or None.

    ``current`` is the saved format (None or unknown: "float"); ``in_use`` the running
    pool's format (`EngineMetrics.kv_format`), which the command line may have set;
    ``generation`` the chat's settings as they are now.
    """

    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel"),
                Binding("ctrl+s", "apply", "Apply", priority=True)]

    def __init__(self, current: str | None, in_use: str = "",
                 generation: GenerationSettings | None = None):
        super().__init__()
        self.current = current if current in KV_CACHE_FORMATS else "float"
        self.in_use = in_use
        self.generation = generation or GenerationSettings()

    def compose(self) -> ComposeResult:
        with VerticalScroll(classes="dialog -wide", id="settings"):
            yield Static("Settings", classes="question")
            yield Static("KV cache format (all chats)", classes="label")
            with RadioSet(id="kv-cache"):
                for name in KV_CACHE_FORMATS:
                    yield RadioButton(describe(name), value=name == self.current, name=name,
                                      id=f"kv-{name}")
            in_use = f"In use now: {short_format(self.in_use)}. " if self.in_use else ""
            yield Static(in_use + HELP, id="kv-cache-help", classes="muted")
            yield Static("Generation (this chat, saved with it)", classes="label",
                         id="generation-label")
            yield GenerationForm(self.generation, id="generation")
            with Horizontal(classes="buttons"):
                yield Button("Apply (ctrl+s)", variant="primary", id="apply")
                yield Button("Cancel (esc)", id="cancel")

    def on_mount(self) -> None:
        formats = self.query_one(RadioSet)
        formats.focus()
        formats._selected = formats.pressed_index  # the cursor on the format in use

    def selected(self) -> str:
        """The format whose button is on."""
        button = self.query_one(RadioSet).pressed_button
        return button.name if button is not None and button.name else self.current

    def action_apply(self) -> None:
        form = self.query_one(GenerationForm)
        try:
            generation = form.values()
        except ValueError:  # the form shows why; the dialog stays
            return
        self.dismiss(SettingsChoice(self.selected(), generation, form.as_default))

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "apply":
            self.action_apply()
        else:
            self.dismiss(None)
