"""The block map: one cell per KV block, wrapped to the panel's width and filling its height.

Each state has its own glyph as well as its own colour, so the map reads the same in a
monochrome terminal or to a colour-blind eye; `LEGEND` says what each state means.
"""

from __future__ import annotations

from rich.text import Text
from textual.widget import Widget

CELL = {".": "·", "#": "█", "S": "◆", "c": "▒"}
STATE = {".": "free", "#": "used", "S": "shared", "c": "cached"}
LEGEND = [
    ("#", "used: holds a live request's tokens"),
    ("S", "shared: one prefix, read by several"),
    ("c", "cached: kept for reuse, evictable"),
    (".", "free"),
]


class BlockMap(Widget):
    """Renders ``engine.block_map()`` ("." free, "#" in use, "S" shared, "c" cached).

    It takes the height it is given (``height: 1fr`` in the panel); a pool with more
    blocks than fit shows its first blocks and "…+N".
    """

    COMPONENT_CLASSES = {"blockmap--free", "blockmap--used", "blockmap--shared",
                         "blockmap--cached"}

    DEFAULT_CSS = """
    BlockMap { height: 1fr; min-height: 2; width: 1fr; }
    BlockMap > .blockmap--free { color: $text-muted 40%; }
    BlockMap > .blockmap--used { color: $primary; }
    BlockMap > .blockmap--shared { color: $warning; }
    BlockMap > .blockmap--cached { color: $success; }
    """

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.cells = ""

    def update(self, cells: str) -> None:
        if cells != self.cells:
            self.cells = cells
            self.refresh()

    def rows(self, width: int, cells: str, max_rows: int | None = None) -> list[str]:
        """The lines drawn at ``width``; the last ends in "…+N" when blocks are left out."""
        width = max(width, 8)
        max_rows = max(1, self.size.height if max_rows is None else max_rows)
        cap = width * max_rows
        suffix = ""
        if len(cells) > cap:
            keep = cap - len(f"…+{len(cells)}")
            suffix = f"…+{len(cells) - keep}"
            cells = cells[:keep]
        lines = [cells[i: i + width] for i in range(0, len(cells), width)] or [""]
        if suffix:
            lines[-1] += "\0" + suffix
        return lines

    def styles_by_state(self) -> dict:
        return {k: self.get_component_rich_style(f"blockmap--{v}") for k, v in STATE.items()}

    def render(self) -> Text:
        styles = self.styles_by_state()
        text = Text(no_wrap=True, overflow="crop")
        for i, line in enumerate(self.rows(self.size.width, self.cells)):
            if i:
                text.append("\n")
            head, _, suffix = line.partition("\0")
            for ch in head:
                text.append(CELL.get(ch, "?"), styles.get(ch))
            text.append(suffix, styles["."])
        return text


class BlockLegend(Widget):
    """What each glyph of the map means, in the map's colours (one line a state)."""

    DEFAULT_CSS = "BlockLegend { height: auto; color: $text-muted; }"

    def __init__(self, block_map: BlockMap, **kwargs):
        super().__init__(**kwargs)
        self.block_map = block_map

    def get_content_height(self, container, viewport, width: int) -> int:
        return len(LEGEND)

    def render(self) -> Text:
        styles = self.block_map.styles_by_state()
        text = Text(no_wrap=True, overflow="ellipsis")
        for i, (ch, meaning) in enumerate(LEGEND):
            if i:
                text.append("\n")
            text.append(CELL[ch], styles[ch]).append(f" {meaning}")
        return text
