"""The block map: one cell per KV block, colored by state, wrapped to the panel's width."""

from __future__ import annotations

from rich.text import Text
from textual.widget import Widget

CELL = {".": "·", "#": "█", "S": "█", "c": "▒"}
STATE = {".": "free", "#": "used", "S": "shared", "c": "cached"}


class BlockMap(Widget):
    """Renders ``engine.block_map()`` ("." free, "#" in use, "S" shared, "c" cached).

    A pool bigger than ``max_rows`` full rows shows its first blocks and "…+N".
    """

    COMPONENT_CLASSES = {"blockmap--free", "blockmap--used", "blockmap--shared",
                         "blockmap--cached"}

    DEFAULT_CSS = """
    BlockMap { height: auto; width: 1fr; }
    BlockMap > .blockmap--free { color: $text-muted 40%; }
    BlockMap > .blockmap--used { color: $primary; }
    BlockMap > .blockmap--shared { color: $warning; }
    BlockMap > .blockmap--cached { color: $success; }
    """

    def __init__(self, *, max_rows: int = 6, **kwargs):
        super().__init__(**kwargs)
        self.max_rows = max_rows
        self.cells = ""

    def update(self, cells: str) -> None:
        if cells != self.cells:
            width = self.size.width
            relayout = len(self.rows(width, self.cells)) != len(self.rows(width, cells))
            self.cells = cells
            self.refresh(layout=relayout)

    def rows(self, width: int, cells: str) -> list[str]:
        """The lines drawn at ``width``; the last ends in "…+N" when blocks are left out."""
        width = max(width, 8)
        cap = width * self.max_rows
        suffix = ""
        if len(cells) > cap:
            keep = cap - len(f"…+{len(cells)}")
            suffix = f"…+{len(cells) - keep}"
            cells = cells[:keep]
        lines = [cells[i: i + width] for i in range(0, len(cells), width)] or [""]
        if suffix:
            lines[-1] += "\0" + suffix
        return lines

    def get_content_height(self, container, viewport, width: int) -> int:
        return 1 + len(self.rows(width, self.cells))  # legend + the map

    def render(self) -> Text:
        styles = {k: self.get_component_rich_style(f"blockmap--{v}") for k, v in STATE.items()}
        text = Text(no_wrap=True, overflow="crop")
        for ch in "#Sc.":
            text.append(CELL[ch], styles[ch]).append(f" {STATE[ch]}  ")
        for line in self.rows(self.size.width, self.cells):
            text.append("\n")
            head, _, suffix = line.partition("\0")
            for ch in head:
                text.append(CELL.get(ch, "?"), styles.get(ch))
            text.append(suffix, styles["."])
        return text
