"""The generation settings form (in F6): temperature, top-p, max tokens, repetition penalty."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Checkbox, Input, Static

from app.settings import GenerationSettings

FIELDS = [  # (name, label, what it does)
    ("temperature", "temperature", "0 = always the likeliest token; 0.7 = varied"),
    ("top_p", "top-p", "0 or 1 = off; 0.9 keeps the likeliest 90%"),
    ("max_tokens", "max tokens", "the longest answer"),
    ("repetition_penalty", "repetition penalty", "1 = off; 1.1 curbs a looping model"),
]


class GenerationForm(Vertical):
    """One chat's generation settings, and whether they become the defaults."""

    DEFAULT_CSS = """
    GenerationForm { height: auto; }
    GenerationForm > Horizontal { height: 1; }
    GenerationForm .field-label { width: 20; color: $text-muted; }
    GenerationForm Input { width: 12; }
    GenerationForm .field-help { width: 1fr; color: $text-muted; margin-left: 2; }
    GenerationForm #gen-default { margin-top: 1; }
    GenerationForm #generation-error { height: auto; color: $error; }
    """

    def __init__(self, values: GenerationSettings, **kwargs):
        super().__init__(**kwargs)
        self.initial = values

    def compose(self) -> ComposeResult:
        for name, label, help_text in FIELDS:
            with Horizontal():
                yield Static(label, classes="field-label")
                yield Input(format_value(getattr(self.initial, name)), id=f"gen-{name}",
                            compact=True, type="integer" if name == "max_tokens" else "number")
                yield Static(help_text, classes="field-help")
        yield Checkbox("Make these the defaults for new chats", id="gen-default", compact=True)
        yield Static("", id="generation-error")

    def values(self) -> GenerationSettings:
        """The settings typed in; raises ValueError (shown in the form) when one is wrong."""
        raw = {name: self.query_one(f"#gen-{name}", Input).value.strip() for name, *_ in FIELDS}
        try:
            values = {k: int(v) if k == "max_tokens" else float(v) for k, v in raw.items()}
            result = GenerationSettings(**values)
        except ValueError as e:
            message = str(e) if "must be" in str(e) else f"not a number: {e}"
            self.query_one("#generation-error", Static).update(message)
            raise ValueError(message) from e
        self.query_one("#generation-error", Static).update("")
        return result

    @property
    def as_default(self) -> bool:
        return self.query_one("#gen-default", Checkbox).value


def format_value(value: float | int) -> str:
    return str(value) if isinstance(value, int) else f"{value:g}"
