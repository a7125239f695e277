"""The cache panel: the KV pool, prefix cache, scheduler and latencies, live from the engine.

In a narrow terminal (or with F2) the panel gives way to `CacheSummary`, one line under
the prompt; F2 brings the panel back.
"""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.reactive import reactive
from textual.widgets import Static

from app.disk_state import disk_line
from app.tui.widgets.block_map import BlockLegend, BlockMap

REFRESH_S = 0.25  # 4 updates a second


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def fmt_seconds(s: float) -> str:
    return f"{s * 1000:.0f} ms" if s < 1 else f"{s:.2f} s"


def short_format(kv_format: str) -> str:
    """A pool format for the eye: "float32", "q8g64", or "K q8g64 V q4g64" when K and V differ.

    The engine names a quantized pool "k=<K format>,v=<V format>" (its prefix-cache key).
    """
    if not kv_format.startswith("k="):
        return kv_format
    parts = dict(p.partition("=")[::2] for p in kv_format.split(","))
    k, v = parts.get("k", ""), parts.get("v", "")
    out = k if k == v else f"K {k} V {v}"
    # a residual format ("...,res=float16"): full blocks quantized, the newest one not
    return out + (f", newest block {parts['res']}" if "res" in parts else "")


def format_rows(m) -> list[tuple[str, str]]:
    """The format rows: the format and its bytes; quantized, its share of fp16 and the saving.

    The saving is per token and over the blocks the pool holds now, in use or cached (what
    they would take more in float16, scales and biases counted).
    """
    fmt, per_token = getattr(m, "kv_format", ""), getattr(m, "bytes_per_token", 0)
    fp16 = getattr(m, "bytes_per_token_fp16", 0)
    if not fmt:
        return []
    if not fmt.startswith("k=") or not fp16 or not per_token:
        return [("format", f"{short_format(fmt)} · {fmt_bytes(per_token)}/tok")]
    saved = held_bytes(m) * (fp16 - per_token) / per_token
    return [("format", f"{short_format(fmt)} · {100 * per_token / fp16:.0f}% of fp16"),
            ("saved", f"{fmt_bytes(fp16 - per_token)}/tok · {fmt_bytes(saved)} held")]


def held_bytes(m) -> int:
    """Bytes the pool holds now: blocks in use plus cached blocks (freed only when needed)."""
    return m.used_bytes + m.blocks_cached * getattr(m, "bytes_per_block", 0)


def summary_line(m) -> str:
    """The collapsed panel: blocks by state, memory held, the hit rate."""
    free = m.blocks_total - m.blocks_used - m.blocks_cached
    return (f"KV █ {m.blocks_used} used  ▒ {m.blocks_cached} cached  · {free} free "
            f"of {m.blocks_total} · {fmt_bytes(held_bytes(m))} held · "
            f"hit {100 * m.hit_rate:.0f}%")


def context_rows(usage: dict | None) -> list[tuple[str, str]]:
    """The last prompt's budget and what used it: history, documents, the summary."""
    if usage is None:  # no prompt on this engine yet
        return []
    rows = [("budget", f"{usage['prompt']:,}/{usage['budget']:,} tok · {usage['policy']}"),
            ("", f"history {usage['history']:,} · docs {usage['documents']:,}"),
            ("", f"summary {usage['summary']:,}" + (
                f" (turns 1–{usage['summarized_turns']})" if usage["summarized_turns"] else ""))]
    if usage["left_out"]:
        rows.append(("", f"{usage['left_out']} oldest turn(s) left out"))
    return rows


def metrics_table(m, last_turn: tuple[int, int] | None, peak: int = 0,
                  context: dict | None = None) -> Table:
    """The panel's numbers as a two-column grid (label, value).

    ``peak``: the most the pool held (used + cached) since the panel's engine came in; the
    engine's own peak counts used blocks only, and could read below "memory".
    """
    t = Table.grid(padding=(0, 1))
    t.add_column(style="dim", no_wrap=True)
    t.add_column()  # wraps: a big pool's 5-digit counts must not be cut off
    total = m.blocks_total or 1
    free = m.blocks_total - m.blocks_used - m.blocks_cached  # cached blocks are evictable
    t.add_row("blocks", f"{m.blocks_used} used · {m.blocks_cached} cached · {free} free")
    t.add_row("", f"{m.blocks_shared} shared · {m.blocks_total} total "
                  f"({100 * m.blocks_used / total:.0f}% used)")
    cached_bytes = held_bytes(m) - m.used_bytes
    t.add_row("memory", f"{fmt_bytes(m.used_bytes)} used + {fmt_bytes(cached_bytes)} cached")
    t.add_row("", f"of {fmt_bytes(m.budget_bytes)} for the KV cache")
    t.add_row("peak", fmt_bytes(max(peak, m.peak_bytes, held_bytes(m))) + " (used + cached)")
    for label, value in format_rows(m):
        t.add_row(label, value)
    t.add_row("hit rate", f"{100 * m.hit_rate:.0f}% · {m.cached_tokens_total:,} tok cached")
    if last_turn is not None:
        cached, prompt = last_turn
        share = f" ({100 * cached / prompt:.0f}%)" if prompt else ""
        t.add_row("last turn", f"{cached:,}/{prompt:,} prompt tok cached{share}")
    else:  # none yet on this engine, or an answer is being written
        t.add_row("last turn", "–")
    for label, value in context_rows(context):
        t.add_row(label, value)
    t.add_row("sequences", f"{m.active_sequences} active · {m.waiting} waiting")
    t.add_row("evictions", f"{m.evictions} · preempted {m.preemptions} · "
                           f"rejected {getattr(m, 'rejections', 0)}")
    t.add_row("freed in", f"{m.release_latency_ms:.2f} ms (last cancel or finish)")
    errors, warning = getattr(m, "disk_write_errors", 0), getattr(m, "disk_warning", None)
    if getattr(m, "disk_state", "") or errors or warning:  # on / read-only / off, and why
        t.add_row("disk", Text(disk_line(m), style="bold yellow" if errors or warning else "",
                               overflow="fold", no_wrap=False))  # the reason in full
    latency = getattr(m, "latency", {}) or {}
    for key, label in (("ttft_s", "TTFT"), ("itl_s", "ITL")):
        p = latency.get(key)
        if p is not None and p.count:
            t.add_row(label, f"p50 {fmt_seconds(p.p50)} · p95 {fmt_seconds(p.p95)}")
        else:
            t.add_row(label, "–")
    return t


class CachePanel(Vertical):
    """Live KV-cache view; polls ``app.engine.metrics()`` and ``block_map()`` while shown."""

    DEFAULT_CSS = """
    CachePanel { width: 44; border-left: vkey $primary 50%; padding: 0 1; }
    CachePanel > .title { text-style: bold; color: $primary; }
    CachePanel > #cache-stats { height: auto; }
    CachePanel > BlockLegend { margin-top: 1; }
    """

    last_turn: reactive[tuple[int, int] | None] = reactive(None)
    """(cached prompt tokens, prompt tokens) of the last finished turn."""
    context: reactive[dict | None] = reactive(None)
    """The last prompt's budget and its use (`app.tui.generation.Turn.usage`)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.peak = 0  # bytes held (used + cached) at most, on this engine
        self.engine: object | None = None

    def compose(self) -> ComposeResult:
        yield Static("KV cache", classes="title")
        yield Static(id="cache-stats")
        block_map = BlockMap(id="block-map")
        yield BlockLegend(block_map)
        yield block_map

    def on_mount(self) -> None:
        self.poll()
        self.set_interval(REFRESH_S, self.poll)

    def watch_last_turn(self) -> None:
        self.poll()

    def watch_context(self) -> None:
        self.poll()

    def poll(self) -> None:
        """Read a snapshot from the app's engine (cheap and thread-safe) and redraw."""
        if not self.display or not self.is_mounted:
            return
        engine = getattr(self.app, "engine", None)
        stats = self.query_one("#cache-stats", Static)
        if engine is None:
            stats.update(Text("no model loaded", style="dim"))
            self.query_one(BlockMap).update("")
            return
        if engine is not self.engine:  # a new model: its own peak
            self.engine, self.peak = engine, 0
        m = engine.metrics()
        self.peak = max(self.peak, held_bytes(m))
        stats.update(Group(metrics_table(m, self.last_turn, self.peak, self.context)))
        self.query_one(BlockMap).update(engine.block_map())


class CacheSummary(Static):
    """The collapsed cache panel: one line of its numbers, polled while shown."""

    DEFAULT_CSS = "CacheSummary { height: 1; padding: 0 2; color: $text-muted; }"

    def on_mount(self) -> None:
        self.poll()
        self.set_interval(REFRESH_S, self.poll)

    def poll(self) -> None:
        if not self.display or not self.is_mounted:
            return
        engine = getattr(self.app, "engine", None)
        text = summary_line(engine.metrics()) if engine is not None else "KV no model loaded"
        self.update(Text("F2▸ " + text, no_wrap=True, overflow="ellipsis"))
