"""`build_pending`: the chat says "building" only when the next load compiles the extension."""

from __future__ import annotations

import copy

import pytest

from engine.model.cpu_ext import build, toolchain


@pytest.fixture
def untried(monkeypatch, tmp_path):
    monkeypatch.setattr(build, "_module", None)
    monkeypatch.setattr(build, "_tried", False)
    monkeypatch.setattr(build, "_off", None)
    failed = copy.copy(build._failed)  # a switch of its own, not yet tripped
    failed.reset()
    monkeypatch.setattr(build, "_failed", failed)
    monkeypatch.setenv("KVCHAT_HOME", str(tmp_path))  # an empty cache: nothing built here
    return monkeypatch


def test_pending_on_an_empty_cache_and_not_once_tried(untried):
    if toolchain.find_compiler() is None:
        pytest.skip("no C++ compiler: nothing would be built")
    assert build.build_pending()
    untried.setattr(build, "_tried", True)  # this process already built or gave up
    assert not build.build_pending()


def test_not_pending_when_it_cannot_or_may_not_build(untried):
    untried.setenv(toolchain.ENV_COMPILER, "/nonexistent/c++")
    assert not build.build_pending()
    untried.delenv(toolchain.ENV_COMPILER)
    untried.setenv(build.ENV_SWITCH, "0")
    assert not build.build_pending()


def test_not_pending_once_built(untried, tmp_path):
    if toolchain.find_compiler() is None:
        pytest.skip("no C++ compiler")
    untried.setattr(build, "library_path", lambda: built)
    built = tmp_path / "lib.so"
    built.write_bytes(b"")
    built.chmod(0o700)
    tmp_path.chmod(0o700)
    assert build.build_pending()  # no seal: it would be rebuilt
    build._seal(built)
    assert not build.build_pending()


def test_a_damaged_or_unsealed_library_is_rebuilt_not_loaded(untried, tmp_path):
    """The cached library is loaded only when its bytes match the digest written when it
    was built: a flipped bit or a lost seal means a rebuild, never a signal at load."""
    if toolchain.find_compiler() is None:
        pytest.skip("no C++ compiler")
    builds = []

    def fake_build(final, compiles, link, tmp_dir):  # the compiler's output, quickly
        builds.append(final)
        final.write_bytes(b"\x7fELF a good library")
        final.chmod(0o700)

    untried.setattr(build, "_build", fake_build)
    final = build.build()
    assert len(builds) == 1 and build._sealed(final) and not build.build_pending()
    assert build.build() == final and len(builds) == 1  # sealed: used as it is
    final.write_bytes(b"\x7fELF a g00d library")  # one damaged byte, same owner and mode
    final.chmod(0o700)
    assert not build._sealed(final) and build.build_pending()
    assert build.build() == final and len(builds) == 2
    assert final.read_bytes() == b"\x7fELF a good library"
    build._seal_path(final).unlink()  # a seal lost: not trusted either
    build.build()
    assert len(builds) == 3 and build._sealed(final)


def test_waiting_on_another_build_says_so_and_gives_up(tmp_path, caplog):
    """Another process's build lock: one line naming it at once, a BuildError at the time
    limit (not a silent wait); the lock's holder writes its pid for the next waiter."""
    import fcntl
    import logging
    import os

    path = tmp_path / "build.lock"
    other = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)  # another open file: another owner
    os.write(other, b"4242")
    fcntl.flock(other, fcntl.LOCK_EX)
    with (caplog.at_level(logging.WARNING, logger="kvchat.cpu_ext"),
          pytest.raises(build.BuildError, match="over 1 s"), build._file_lock(path, 0.6)):
        pass
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "pid 4242" in said[0] and "giving up after 1 s" in said[0]
    os.close(other)  # released: the next one takes it and names itself
    with build._file_lock(path, 0.6):
        assert path.read_text() == str(os.getpid())


def test_a_build_counts_its_steps(monkeypatch, tmp_path):
    """build_progress (the chat's status line): files compiled, then the link; None after."""
    seen = []

    def fake_run(cmd):
        seen.append((cmd[0], build.build_progress))
        if cmd[0] == "link":
            (tmp_path / toolchain.library_name()).write_bytes(b"lib")

    monkeypatch.setattr(build, "run", fake_run)
    compiles = [["cc", str(i)] for i in range(5)]
    build._build(tmp_path / "final.so", compiles, ["link"], tmp_path)
    assert [p for c, p in seen if c == "link"] == [(5, 6)]
    assert all(p is not None and p[1] == 6 and p[0] < 5 for c, p in seen if c == "cc")
    assert build.build_progress is None and (tmp_path / "final.so").exists()
