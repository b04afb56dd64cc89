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
