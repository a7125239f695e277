"""The KV cache format setting: chosen in the TUI (F6), saved, applied by a reload, shown
in the cache panel; the command line's KV flags win over it for their run.

The engine factory is the real `default_engine_factory` with `load_engine` replaced by a
recorder, so the tests see the exact `EngineConfig` each engine would be built from.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import pytest
from rich.console import Console
from test_tui_app import SIZE, ask, boxes, record_notices, wait_for
from test_tui_fakes import FakeEngine, fake_metrics, long_reply

from app import settings
from app.conversations import ConversationStore
from app.settings import KV_CACHE_FORMATS, KV_KIVI
from app.tui.app import ChatApp
from app.tui.engine_factory import default_engine_factory, kv_flags, with_kv_cache
from app.tui.screens.settings import SettingsScreen, describe
from app.tui.widgets.cache_panel import CachePanel, metrics_table, short_format
from engine import EngineConfig

# (K bits, V bits) -> the settings' name, to build a fake engine in the config's format
NAMES = {tuple(b or 16 for b in bits): name for name, bits in KV_CACHE_FORMATS.items()
         if name not in KV_KIVI}


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A private settings file for the test (the app remembers with remember=True)."""
    monkeypatch.setenv("KVCHAT_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def configs(monkeypatch) -> list[EngineConfig]:
    """Every config the default factory builds an engine from; the engines are fakes."""
    seen: list[EngineConfig] = []

    def load_engine(spec, *, weights="auto", config=None):
        seen.append(config)
        name = NAMES.get(kv_flags(config) or (16, 16))
        return FakeEngine(kv_cache=f"{name}-kivi" if config.kv_key_channel else name)

    monkeypatch.setattr("app.tui.engine_factory.load_engine", load_engine)
    return seen


def chat_app(tmp_path, config: EngineConfig | None = None) -> ChatApp:
    """The app as `kvchat chat` builds it: the command line's config in the factory."""
    factory = partial(default_engine_factory, config=config or EngineConfig())
    return ChatApp(engine_factory=factory, store=ConversationStore(tmp_path / "conversations"))


def panel_text(app) -> str:
    """The cache panel's numbers as one line of words, laid out at its width."""
    console = Console(width=40, record=True)
    console.print(metrics_table(app.engine.metrics(), None))
    return " ".join(console.export_text().split())


async def test_choosing_q8_saves_it_and_reloads_the_engine_in_it(home, configs, tmp_path):
    app = chat_app(tmp_path)
    notices = record_notices(app)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine is not None)
        first = app.engine
        assert configs[-1].kv_bits is None  # nothing saved: the engine's default format
        app.chat.query_one("PromptInput").text = "hello"
        await pilot.press("enter")
        await wait_for(pilot, lambda: not app.chat.generating)
        assert app.focused is app.chat.query_one("PromptInput")  # it passes F6 on
        await pilot.press("f6")
        await wait_for(pilot, lambda: isinstance(app.screen, SettingsScreen))
        assert app.screen.selected() == "float"
        await pilot.press("down", "enter")  # the RadioSet has focus: q8 is the next option
        assert app.screen.selected() == "q8"
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: app.engine is not first and not app.model_loading)
        assert settings.load_settings().kv_cache == "q8"
        assert (configs[-1].kv_bits, configs[-1].k_bits, configs[-1].v_bits) == (8, None, None)
        assert first.stopped  # the old engine gave its pool back
        assert len(boxes(app)) == 2  # the chat is kept
        assert "Reloaded SmolLM2-135M-Instruct (default)." in notices
        assert "q8g64 · 53% of fp16" in panel_text(app)
        assert app.chat.query_one(CachePanel).display
        await pilot.press("f6")  # the dialog now starts on the saved choice
        await wait_for(pilot, lambda: isinstance(app.screen, SettingsScreen))
        assert app.screen.selected() == "q8"
        assert "In use now: q8g64." in str(app.screen.query_one("#kv-cache-help").render())
        await pilot.press("escape")
    # the next start builds its first engine in the saved format
    app = chat_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine is not None)
        assert configs[-1].kv_bits == 8


async def test_command_line_flags_win_over_the_saved_format(home, configs, tmp_path):
    settings.save_settings(kv_cache="q4")
    app = chat_app(tmp_path, EngineConfig(kv_bits=8))  # as `kvchat chat --kv-bits 8`
    notices = record_notices(app)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine is not None)
        assert configs[-1].kv_bits == 8
        assert app.engine.metrics().kv_format == "k=q8g64,v=q8g64"
        assert any("command line" in n and "q4" in n for n in notices)
    assert settings.load_settings().kv_cache == "q4"  # kept for runs without the flags


async def test_the_format_waits_for_a_running_answer(home, configs, tmp_path):
    app = chat_app(tmp_path)
    notices = record_notices(app)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine is not None)
        app.engine.reply, app.engine.delay = long_reply(400), 0.01
        app.chat.query_one("PromptInput").text = "go"
        await pilot.press("enter")
        await wait_for(pilot, lambda: len(boxes(app)) == 2 and boxes(app)[1].text)
        app.set_kv_cache("q4")
        assert any("press Esc before changing the KV cache" in n for n in notices)
        assert app.kv_cache is None and len(configs) == 1
        await pilot.press("escape")
        await wait_for(pilot, lambda: not app.chat.generating)
    assert settings.load_settings().kv_cache is None


@pytest.mark.parametrize(("name", "fields"), [
    ("float", (16, None, None)),
    ("q8", (8, None, None)),
    ("q4", (4, None, None)),
    ("k8v4", (None, 8, 4)),
    (None, (None, None, None)),
    ("q2", (None, None, None)),  # a newer version's format: the engine's default
])
def test_config_from_the_setting(name, fields):
    config, notice = with_kv_cache(EngineConfig(block_size=32), name)
    assert (config.kv_bits, config.k_bits, config.v_bits) == fields
    assert config.block_size == 32 and notice is None


@pytest.mark.parametrize(("flags", "name", "noticed"), [
    ({"kv_bits": 8}, "q8", False),
    ({"kv_bits": 8}, "q4", True),
    ({"k_bits": 8, "v_bits": 4}, "k8v4", False),
    ({"kv_bits": 16}, "float", False),
    ({"kv_bits": 4, "k_bits": 8}, "k8v4", False),  # K's flag beats --kv-bits, as in the engine
    ({"v_bits": 4}, "q4", True),  # K unquantized, V 4-bit: not q4
])
def test_flags_are_kept_and_a_difference_is_noticed(flags, name, noticed):
    given = EngineConfig(**flags)
    config, notice = with_kv_cache(given, name)
    assert config == given
    assert (notice is not None) == noticed


def test_cache_panel_shows_the_quantized_format_and_the_saving():
    lines = {}
    for name in ("float", "q8", "k8v4"):
        console = Console(width=40, record=True)
        console.print(metrics_table(fake_metrics(name), None))
        lines[name] = " ".join(console.export_text().split())
    assert "format float32 · 45.0 KiB/tok" in lines["float"]
    assert "saved" not in lines["float"]
    assert "format q8g64 · 53% of fp16" in lines["q8"]
    # 10,800 bytes a token less than float16, over the 192 tokens of the 6 blocks in use
    # and the 6 cached ones (cached blocks hold their data until they are needed)
    assert "saved 10.5 KiB/tok · 2.0 MiB held" in lines["q8"]
    idle = dataclasses.replace(fake_metrics("q8"), used_bytes=0, blocks_used=0)
    console = Console(width=40, record=True)
    console.print(metrics_table(idle, None))
    assert "1012.5 KiB held" in " ".join(console.export_text().split())  # none in use
    big = dataclasses.replace(idle, blocks_total=29126, blocks_free=14563, blocks_cached=14563)
    console = Console(width=40, record=True)  # a big pool: every count whole, wrapped
    console.print(metrics_table(big, None))
    text = " ".join(console.export_text().split())
    assert "0 used · 14563 cached · 14563 free" in text and "29126 total" in text
    assert "K q8g64 V q4g64 · 41% of fp16" in lines["k8v4"]
    assert short_format("k=q8g64,v=float32") == "K q8g64 V float32"


def test_option_labels_come_from_the_pools_accounting():
    assert describe("q8") == "q8 — 8-bit K and V · 53% of fp16's bytes · +0.1% perplexity"
    assert describe("q4") == ("q4 — 4-bit K and V · 28% of fp16's bytes · +6.6% perplexity: "
                              "costly")  # the measured cost over KV_COSTLY_PCT says so
    assert describe("k8v4") == ("k8v4 — 8-bit K, 4-bit V · 41% of fp16's bytes · +0.4% "
                                "perplexity")
    assert "default" in describe("float")


async def test_generation_settings_per_chat_and_as_defaults(home, tmp_path):
    from app.tui.widgets.generation_form import GenerationForm

    store = ConversationStore(tmp_path / "conversations")
    app = ChatApp(engine_factory=lambda spec, kv_cache=None: FakeEngine(), store=store)
    async with app.run_test(size=(130, 40)) as pilot:
        await wait_for(pilot, lambda: app.engine is not None)
        assert app.sampling().temperature == 0.0 and app.sampling().max_tokens == 512
        await pilot.press("f6")
        await wait_for(pilot, lambda: isinstance(app.screen, SettingsScreen))
        screen = app.screen
        screen.query_one("#gen-temperature").value = "hot"
        await pilot.press("ctrl+s")
        assert app.screen is screen  # refused, and said why
        assert "not a number" in str(screen.query_one("#generation-error").render())
        screen.query_one("#gen-temperature").value = "0.7"
        screen.query_one("#gen-repetition_penalty").value = "1.1"
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: app.screen is app.chat)
        params = app.sampling()
        assert (params.temperature, params.repetition_penalty, params.top_p) == (0.7, 1.1, 0.0)
        assert app.chat.conversation.params == {"temperature": 0.7, "repetition_penalty": 1.1}
        await ask(pilot, app, "hello")
        cid = app.chat.conversation.id
        assert "own sampling" in str(app.chat.query_one("#status").render())
        # a new chat answers with the defaults; ticked, max tokens 64 becomes the default
        await pilot.press("ctrl+n")
        await wait_for(pilot, lambda: not boxes(app))
        assert app.sampling().temperature == 0.0
        await pilot.press("f6")
        await wait_for(pilot, lambda: isinstance(app.screen, SettingsScreen))
        app.screen.query_one("#gen-max_tokens").value = "64"
        app.screen.query_one("#gen-default").value = True
        assert isinstance(app.screen.query_one(GenerationForm), GenerationForm)
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: app.screen is app.chat)
        assert app.sampling().max_tokens == 64 and app.chat.conversation.params == {}
    assert settings.generation_defaults().max_tokens == 64
    assert store.load(cid).params == {"temperature": 0.7, "repetition_penalty": 1.1}
    assert settings.load_settings().kv_cache is None  # the format was left as it was


def test_typed_sampling_flags_win_over_saved_defaults_and_untyped_ones_do_not(home, tmp_path):
    from app.cli import make_parser

    settings.save_settings(generation={"max_tokens": 64, "temperature": 0.5})
    store = ConversationStore(tmp_path / "conversations")

    def app_for(argv):
        args = make_parser().parse_args(["chat", *argv])
        app = ChatApp(engine_factory=lambda spec, kv_cache=None: FakeEngine(), store=store,
                      max_tokens=args.max_tokens, temperature=args.temp)
        app.saved_generation = settings.load_settings().generation
        return app.generation_defaults()

    assert (app_for([]).max_tokens, app_for([]).temperature) == (64, 0.5)
    # typing the built-in values is still a choice: it wins for this run
    typed = app_for(["--max-tokens", "512", "--temp", "0"])
    assert (typed.max_tokens, typed.temperature) == (512, 0.0)
    assert app_for(["--temp", "0.9"]).max_tokens == 64


def test_a_kivi_format_builds_the_residual_per_channel_pool():
    config, notice = with_kv_cache(EngineConfig(), "k8v4-kivi")
    assert notice is None and (config.k_bits, config.v_bits) == (8, 4)
    assert config.kv_residual and config.kv_key_channel
    back, _ = with_kv_cache(config, "q8")  # flags (k8v4) set: the command line wins
    assert back is config
    plain, _ = with_kv_cache(EngineConfig(), "q4")
    assert not (plain.kv_residual or plain.kv_key_channel)
    assert "K per channel" in describe("q4-kivi") and "costly" not in describe("q4-kivi")
    # they carry context shift and speculation now: nothing to warn of before Apply
    assert "context shift" not in describe("q8-kivi") and "speculation" not in describe("q8-kivi")
    assert short_format("k=q4c16r1,v=q4g64r1,res=float16") == \
        "K q4c16r1 V q4g64r1, newest block float16"
