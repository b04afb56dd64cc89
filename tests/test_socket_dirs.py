"""Socket directories left by a killed server are removed by the next one; a running server's
are kept."""

from __future__ import annotations

import os
import subprocess
import sys

from nori_jax.socket_dirs import remove_stale


def test_directories_of_processes_that_no_longer_run_are_removed(tmp_path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # its id is free now
    stale = [tmp_path / f"nori-core-{gone.pid}-abc", tmp_path / f"nori-api-{gone.pid}-def"]
    live = [tmp_path / f"nori-core-{os.getpid()}-ghi", tmp_path / f"nori-api-{os.getppid()}-x"]
    other = [tmp_path / "nori-core-notapid-y", tmp_path / f"other-{gone.pid}-z"]
    for d in stale + live + other:
        d.mkdir()
        (d / "in-1").touch()  # a socket file's place
    removed = remove_stale(str(tmp_path))
    assert sorted(removed) == sorted(str(d) for d in stale)
    assert not any(d.exists() for d in stale)
    assert all(d.exists() for d in live + other)
