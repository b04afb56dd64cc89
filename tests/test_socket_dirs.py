"""Socket directories left by a killed server are removed by the next one; a running server's
are kept, and so is anything else in the temporary directory."""

from __future__ import annotations

import os
import subprocess
import sys

from nori_jax.socket_dirs import remove_stale


def test_directories_of_processes_that_no_longer_run_are_removed(tmp_path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # its id is free now
    dirs = {
        "nori-core-abc": gone.pid,  # stale
        "nori-api-def": gone.pid,  # stale
        "nori-core-ghi": os.getpid(),  # running
        "nori-api-jkl": os.getppid(),  # running
        "nori-core-old": None,  # no owner file: from before it, left alone
        "other-mno": gone.pid,  # not ours
    }
    for name, pid in dirs.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "in-1").touch()  # a socket file's place
        if pid is not None:
            (tmp_path / name / "owner.pid").write_text(str(pid))
    removed = remove_stale(str(tmp_path))
    stale = {str(tmp_path / "nori-core-abc"), str(tmp_path / "nori-api-def")}
    assert set(removed) == stale
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        n for n in dirs if str(tmp_path / n) not in stale
    )


def test_a_temporary_directory_too_long_for_socket_paths_falls_back_to_tmp(tmp_path, monkeypatch):
    """A TMPDIR whose socket paths pass 107 bytes made every server's start a ZeroMQ traceback;
    the directory goes to /tmp instead, and the longest socket name binds there."""
    import tempfile

    import zmq

    from nori_jax import socket_dirs

    deep = tmp_path / ("d" * 60) / ("e" * 40)
    deep.mkdir(parents=True)
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    assert socket_dirs.socket_root() == socket_dirs.FALLBACK_ROOT
    path = socket_dirs.socket_dir("api")
    try:
        assert os.path.dirname(path) == socket_dirs.FALLBACK_ROOT
        ctx = zmq.Context()
        sock = ctx.socket(zmq.PULL)
        sock.bind(f"ipc://{path}/api-999-out")  # the longest name the server gives a socket
        sock.close(linger=0)
        ctx.term()
    finally:
        import shutil

        shutil.rmtree(path, ignore_errors=True)
    short = tempfile.mkdtemp(dir="/tmp")  # pytest's own tmp_path can be too long already
    try:
        monkeypatch.setattr(tempfile, "tempdir", short)
        assert socket_dirs.socket_root() == short  # a TMPDIR that fits is used
    finally:
        os.rmdir(short)


def test_no_directory_that_fits_is_a_clear_error(tmp_path, monkeypatch):
    import tempfile

    import pytest

    from nori_jax import socket_dirs

    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    monkeypatch.setattr(socket_dirs, "FALLBACK_ROOT", str(deep))
    with pytest.raises(ValueError, match="too long for the engine's ipc socket paths"):
        socket_dirs.socket_dir("core")
