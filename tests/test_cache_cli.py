"""`nori-jax cache info / clear` on caches in a temporary directory: clear deletes the caches'
own entries and nothing else."""

from __future__ import annotations

from nori_jax.cli import main

PARAMS_ENTRY = "0123456789abcdef0123456789abcdef"  # a checkpoint's directory: a 32-digit hash
XLA_ENTRY = "jit_forward-5f3a-cache"


def test_info_then_clear(tmp_path, monkeypatch, capsys):
    params, xla = tmp_path / "params", tmp_path / "xla"
    (params / PARAMS_ENTRY).mkdir(parents=True)
    (params / PARAMS_ENTRY / "data").write_bytes(b"x" * 2**20)
    xla.mkdir()
    (xla / XLA_ENTRY).write_bytes(b"y" * 1000)
    monkeypatch.setenv("NORI_JAX_PARAM_CACHE", str(params))
    monkeypatch.setenv("NORI_JAX_CACHE_DIR", str(xla))

    assert main(["--log-level", "WARNING", "cache", "info"]) == 0
    out = capsys.readouterr().out
    assert f"converted parameters: {params}: 1 entries, 1.0 MiB" in out
    assert f"XLA compilation cache: {xla}: 1 entries" in out

    assert main(["--log-level", "WARNING", "cache", "clear", "--xla"]) == 0
    assert list(xla.iterdir()) == [] and (params / PARAMS_ENTRY).exists()
    assert main(["--log-level", "WARNING", "cache", "clear"]) == 0
    out = capsys.readouterr().out
    assert list(params.iterdir()) == []
    assert f"removed 1 entries from {params} (1.0 MiB)" in out


def test_clear_keeps_what_is_not_the_caches_own(tmp_path, monkeypatch, capsys):
    """A --compilation-cache-dir naming another directory lost all of it to a whole-tree removal;
    and a cache directory that is a link to another disk made clear fail."""
    home = tmp_path / "home"
    (home / "work").mkdir(parents=True)
    (home / "work" / "notes.txt").write_text("keep me")
    (home / "model.safetensors").write_bytes(b"w")
    (home / XLA_ENTRY).write_bytes(b"y")
    assert main(["--log-level", "WARNING", "cache", "clear", "--xla", "--compilation-cache-dir",
                 str(home)]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "kept 2 entries that are not the cache's own" in out
    assert sorted(p.name for p in home.iterdir()) == ["model.safetensors", "work"]
    assert (home / "work" / "notes.txt").read_text() == "keep me"
    disk = tmp_path / "disk"
    disk.mkdir()
    (disk / XLA_ENTRY).write_bytes(b"y")
    link = tmp_path / "xla-link"
    link.symlink_to(disk)
    assert main(["--log-level", "WARNING", "cache", "clear", "--xla", "--compilation-cache-dir",
                 str(link)]) == 0  # fmt: skip
    assert link.is_symlink() and list(disk.iterdir()) == []
