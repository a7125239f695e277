"""How the TUI builds an engine: the command line's config plus the KV cache format setting.

The KV flags (--kv-bits, --k-bits, --v-bits) fix the format for the whole run, as other
flags override saved settings: the format chosen in the app's settings applies only when
the command line set none. When the flags win over a different choice, the engine carries
a notice saying so, which the app shows like the engine's own notices.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from app import models_hub
from app.engine_args import load_engine
from app.engine_like import EngineLike
from app.settings import kv_cache_bits, kv_cache_kivi
from engine import EngineConfig


class EngineFactory(Protocol):
    """Builds an engine (not started) for a model spec, in a KV cache format of the settings."""

    def __call__(self, spec: str | None, *, kv_cache: str | None = None) -> EngineLike: ...


def kv_flags(config: EngineConfig) -> tuple[int, int] | None:
    """(K bits, V bits) the config's KV fields ask for, 16 = unquantized; None when unset."""
    if config.kv_bits is None and config.k_bits is None and config.v_bits is None:
        return None
    # the engine's own precedence (engine.wiring.kv_quant): a side's bits beat kv_bits
    return (config.k_bits or config.kv_bits or 16, config.v_bits or config.kv_bits or 16)


def with_kv_cache(config: EngineConfig | None,
                  kv_cache: str | None) -> tuple[EngineConfig, str | None]:
    """The config to build with ``kv_cache`` (a `KV_CACHE_FORMATS` name), and a notice.

    The notice is set when the config's KV fields (the command line's flags) ask for
    another format: they are kept for this run. An unset or unknown name changes nothing.
    """
    config = config or EngineConfig()
    bits = kv_cache_bits(kv_cache)
    if bits is None:
        return config, None
    k, v = (b or 16 for b in bits)
    kivi = kv_cache_kivi(kv_cache)
    flags = kv_flags(config)
    if flags is not None:
        if flags == (k, v) and config.kv_key_channel == kivi:
            return config, None
        return config, (f"--kv-bits/--k-bits/--v-bits on the command line set this run's "
                        f"KV cache; the {kv_cache} format of the settings applies when "
                        f"kvchat starts without them")
    layout = {"kv_residual": kivi, "kv_key_channel": kivi}
    if k == v:  # one number, as --kv-bits would give
        return dataclasses.replace(config, kv_bits=k, k_bits=None, v_bits=None, **layout), None
    return dataclasses.replace(config, kv_bits=None, k_bits=k, v_bits=v, **layout), None


def default_engine_factory(spec: str | None, *, weights: str = "auto",
                           config: EngineConfig | None = None,
                           kv_cache: str | None = None) -> EngineLike:
    """Load ``spec`` (a hub repo id in our cache resolves to its snapshot) into an Engine.

    ``config`` comes from the command line (`app.engine_config.config_from_args`);
    ``kv_cache`` is the format chosen in the settings (see `with_kv_cache`).
    """
    config, notice = with_kv_cache(config, kv_cache)
    engine = load_engine(models_hub.resolve_spec(spec), weights=weights, config=config)
    engine.loaded.name = spec or models_hub.DEFAULT_MODEL
    if notice:
        engine.notices.append(notice)
    return engine
