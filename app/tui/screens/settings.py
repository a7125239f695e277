"""Settings: the KV cache format, saved with the other settings and applied by a reload."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, RadioButton, RadioSet, Static

from app.settings import KV_CACHE_FORMATS
from app.tui.widgets.cache_panel import short_format
from engine import EngineConfig
from engine.kvcache.kv_cache import QuantSpec

HELP = ("Apply reloads the model in the new format: the chat is kept, cached prompt prefixes "
        "are not. The choice is saved for later runs; --kv-bits, --k-bits and --v-bits on "
        "the command line override it for their run.")


def share_of_fp16(k_bits: int | None, v_bits: int | None) -> float:
    """Bytes of a quantized K/V pair against float16, from the pool's own accounting.

    One group's row stands for any head dim the group divides (the engine requires that).
    """
    group = EngineConfig().kv_group_size
    rows = [QuantSpec(b, group).bytes_per_row(group) if b else 2 * group
            for b in (k_bits, v_bits)]
    return sum(rows) / (2 * 2 * group)


def describe(name: str) -> str:
    """One option's label, e.g. "q8 — 8-bit K and V · 53% of fp16's bytes"."""
    k, v = KV_CACHE_FORMATS[name]
    if k is None and v is None:
        return f"{name} — unquantized, in the model's float dtype (default)"
    sides = f"{k}-bit K and V" if k == v else f"{k or 16}-bit K, {v or 16}-bit V"
    return f"{name} — {sides} · {100 * share_of_fp16(k, v):.0f}% of fp16's bytes"


class SettingsScreen(ModalScreen[str | None]):
    """Choose the KV cache format; dismisses with its name (a `KV_CACHE_FORMATS` key) or None.

    ``current`` is the saved choice (None or unknown: "float"); ``in_use`` the running
    pool's format (`EngineMetrics.kv_format`), which the command line may have set.
    """

    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel"),
                Binding("ctrl+s", "apply", "Apply", priority=True)]

    def __init__(self, current: str | None, in_use: str = ""):
        super().__init__()
        self.current = current if current in KV_CACHE_FORMATS else "float"
        self.in_use = in_use

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog -wide", id="settings"):
            yield Static("Settings", classes="question")
            yield Static("KV cache format", classes="label")
            with RadioSet(id="kv-cache"):
                for name in KV_CACHE_FORMATS:
                    yield RadioButton(describe(name), value=name == self.current, name=name,
                                      id=f"kv-{name}")
            in_use = f"In use now: {short_format(self.in_use)}. " if self.in_use else ""
            yield Static(in_use + HELP, id="kv-cache-help", classes="muted")
            with Horizontal(classes="buttons"):
                yield Button("Apply (ctrl+s)", variant="primary", id="apply")
                yield Button("Cancel (esc)", id="cancel")

    def on_mount(self) -> None:
        self.query_one(RadioSet).focus()

    def selected(self) -> str:
        """The format whose button is on."""
        button = self.query_one(RadioSet).pressed_button
        return button.name if button is not None and button.name else self.current

    def action_apply(self) -> None:
        self.dismiss(self.selected())

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "apply":
            self.action_apply()
        else:
            self.dismiss(None)
