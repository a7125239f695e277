"""`kvchat generate --json` in a new interpreter: a run whose only warm source is the disk store.

Its own module because two checks of the disk prefix cache need that run: `kvchat cache
verify` (`app.cache_cli`) and `kvchat bench prefix` (`app.bench.prefix`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from engine.errors import KVChatError


def generate_in_fresh_process(prompt: str, model: str | None, max_tokens: int,
                              cache_dir: str, *, disk_cache: bool = True) -> dict:
    """Generate from ``prompt`` in a new process over ``cache_dir`` (not read or written
    with ``disk_cache`` False: a cold run): its JSON result."""
    with tempfile.TemporaryDirectory(prefix="kvchat-prompt-") as tmp:
        prompt_file = Path(tmp) / "prompt.txt"
        prompt_file.write_text(prompt)
        child = subprocess.run(
            [sys.executable, "-m", "app.cli", "generate", "--json", "--prompt-file",
             str(prompt_file), "--model", model or "default", "--max-tokens", str(max_tokens),
             "--cache-dir", cache_dir, *([] if disk_cache else ["--no-disk-cache"])],
            capture_output=True, text=True, env=dict(os.environ), check=False)
    if child.returncode != 0:
        raise KVChatError(f"the fresh process failed: {child.stderr.strip()}")
    return json.loads(child.stdout)
