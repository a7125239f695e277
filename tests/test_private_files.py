"""The cache root is private whatever the umask; a loose or foreign BLAS shim is never loaded.

The shim checks run on files laid out by the test (built, not loaded: no library is
ever loaded into the test process). The umask-000 test runs kvchat as a user does, in one
child process, and then walks everything it wrote under KVCHAT_HOME.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from engine.model import blas, gemv_shim

ROOT = Path(__file__).resolve().parents[1]
needs_cc = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="needs a C compiler"
)
NOBODY = 65534


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCHAT_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def is_elf(path: Path) -> bool:
    return path.read_bytes()[:4] == b"\x7fELF"


def plant_shim(data: bytes = b"not a library", *, file_mode=0o700, dir_mode=0o700) -> Path:
    """Put a file where the compiled shim is cached, as an attacker or an old kvchat would."""
    path = gemv_shim.shim_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    os.chmod(path.parent, dir_mode)
    os.chmod(path, file_mode)
    return path


# -- the GEMV shim -----------------------------------------------------------------


@needs_cc
def test_a_fresh_build_is_private_and_reused(home):
    built = gemv_shim.build()
    assert built == gemv_shim.shim_path() and is_elf(built)
    assert gemv_shim.shim_is_trusted(built)
    assert (mode(built), mode(built.parent), mode(home)) == (0o700, 0o700, 0o700)
    inode = built.stat().st_ino
    assert gemv_shim.build() == built and built.stat().st_ino == inode  # not rebuilt
    assert [p.name for p in built.parent.iterdir()] == [built.name]  # no temp file left


def test_the_check_refuses_loose_foreign_or_linked_shims(home, tmp_path, monkeypatch):
    path = plant_shim()
    assert gemv_shim.shim_is_trusted(path)
    for loose in (0o720, 0o702, 0o777):
        os.chmod(path, loose)
        assert not gemv_shim.shim_is_trusted(path)
    os.chmod(path, 0o700)
    os.chmod(path.parent, 0o770)  # a writable directory lets others swap the file
    assert not gemv_shim.shim_is_trusted(path)
    os.chmod(path.parent, 0o700)
    real = tmp_path / "elsewhere.so"
    path.rename(real)
    path.symlink_to(real)
    assert not gemv_shim.shim_is_trusted(path)
    path.unlink()
    real.rename(path)
    uid = os.geteuid()
    monkeypatch.setattr(os, "geteuid", lambda: uid + 1)  # as if another user owned it all
    assert not gemv_shim.shim_is_trusted(path)


@needs_cc
@pytest.mark.parametrize("file_mode", [0o770, 0o777, 0o702])
def test_a_writable_shim_is_rebuilt_not_loaded(home, file_mode):
    path = plant_shim(file_mode=file_mode)
    built = gemv_shim.build()
    assert built == path and is_elf(built)  # replaced by a fresh compile
    assert mode(built) == 0o700 and gemv_shim.shim_is_trusted(built)


@needs_cc
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the file away")
def test_a_foreign_shim_is_rebuilt(home):
    path = plant_shim()
    os.chown(path, NOBODY, NOBODY)
    built = gemv_shim.build()
    assert built == path and is_elf(built) and os.stat(built).st_uid == 0


@needs_cc
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the directory away")
def test_a_foreign_shim_directory_is_left_alone(home):
    path = plant_shim(dir_mode=0o777)
    os.chown(path.parent, NOBODY, NOBODY)
    assert gemv_shim.build() is None  # only the cached shim is loaded: nowhere else to build
    assert not gemv_shim.load("/nonexistent/libopenblas.so")
    assert mode(path.parent) == 0o777 and path.read_bytes() == b"not a library"
    assert [p.name for p in path.parent.iterdir()] == [path.name]


def test_gemv_shim_off_builds_nothing(home, monkeypatch):
    monkeypatch.setenv("KVCHAT_GEMV_SHIM", "0")
    monkeypatch.setattr(blas, "loaded_path", "/nonexistent/libopenblas.so")  # as if preloaded
    monkeypatch.setattr(blas, "_probed", None)
    monkeypatch.setattr(gemv_shim, "build", lambda: pytest.fail("built the shim"))
    blas.prepare_cache()
    assert gemv_shim.load("/nonexistent/libopenblas.so") is False
    assert not home.exists()


# -- everything kvchat writes, under umask 000 ---------------------------------------

# One process, as a user's first run in a fresh KVCHAT_HOME: `kvchat generate` (the GGUF
# conversion, the GEMV shim, the CPU extension's build, the disk prefix store, the
# fingerprint memo), then a saved chat and settings. The extension's compiler is the only
# stand-in: with argv[1] (this session's build of the same sources) each compile writes
# its object as cc would under umask 000 (0666) and the link copies that build in as 0777,
# so kvchat's own directories, lock, temporary dir and final file are what is checked,
# without a second ~30-80 s compile.
_RUN_AS_USER = textwrap.dedent("""
    import os, shutil, sys
    os.umask(0)
    prebuilt = sys.argv[1]
    if prebuilt:
        from engine.model.cpu_ext import build

        def compiler(cmd):
            out = cmd[cmd.index("-o") + 1]
            if "-shared" in cmd:
                shutil.copyfile(prebuilt, out)
            else:
                open(out, "wb").close()
            os.chmod(out, 0o777 if "-shared" in cmd else 0o666)

        build.run = compiler
    from app.cli import main
    if main(["generate", "--prompt", "hi", "--max-tokens", "2"]) != 0:
        sys.exit("generate failed")
    from engine.model.cpu_ext import build
    if prebuilt and not build.available():
        sys.exit("the CPU extension did not load: " + str(build.unavailable_reason()))
    from app import settings
    from app.conversations import ConversationStore
    store = ConversationStore()
    conv = store.new(model="default")
    conv.add("user", "hi")
    store.save(conv)
    settings.remember_model("default")
    settings.save_settings(theme="textual-light")
""")


@pytest.mark.slow
@pytest.mark.subprocess
def test_everything_written_under_umask_000_is_private(tmp_path):
    from engine.model.cpu_ext import build

    prebuilt = str(build.library_path()) if build.available() else ""
    home = tmp_path / "home"
    env = dict(os.environ, KVCHAT_HOME=str(home), PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", _RUN_AS_USER, prebuilt], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr
    seen, loose = set(), []
    for dirpath, dirnames, filenames in os.walk(home):
        for name in [*dirnames, *filenames]:
            path = Path(dirpath) / name
            seen.add(path.relative_to(home).parts[0])
            st = os.lstat(path)
            wanted = {0o700} if stat.S_ISDIR(st.st_mode) else {0o600}
            if path.suffix == ".so":
                wanted = {0o600, 0o700}
            if stat.S_IMODE(st.st_mode) not in wanted or not (
                stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)
            ):
                loose.append(f"{oct(st.st_mode)} {path.relative_to(home)}")
    assert mode(home) == 0o700
    # the disk prefix store, converted model, memo, shim, chats and settings were all written
    assert {"prefix", "models", "fingerprints.json", "conversations", "settings.json"} <= seen
    if shutil.which("cc") or shutil.which("gcc"):
        assert "blas" in seen
    if prebuilt:
        assert "cpu_ext" in seen  # the extension's build went through kvchat's steps here
    assert loose == []
