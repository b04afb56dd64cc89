"""`nori-jax cache info / clear` on caches in a temporary directory."""

from __future__ import annotations

from nori_jax.cli import main


def test_info_then_clear(tmp_path, monkeypatch, capsys):
    params, xla = tmp_path / "params", tmp_path / "xla"
    (params / "entry").mkdir(parents=True)
    (params / "entry" / "data").write_bytes(b"x" * 2**20)
    xla.mkdir()
    (xla / "program").write_bytes(b"y" * 1000)
    monkeypatch.setenv("NORI_JAX_PARAM_CACHE", str(params))
    monkeypatch.setenv("NORI_JAX_CACHE_DIR", str(xla))

    assert main(["--log-level", "WARNING", "cache", "info"]) == 0
    out = capsys.readouterr().out
    assert f"converted parameters: {params}: 1 entries, 1.0 MiB" in out
    assert f"XLA compilation cache: {xla}: 1 entries" in out

    assert main(["--log-level", "WARNING", "cache", "clear", "--xla"]) == 0
    assert not xla.exists() and params.exists()
    assert main(["--log-level", "WARNING", "cache", "clear"]) == 0
    out = capsys.readouterr().out
    assert not params.exists() and f"removed {params} (1.0 MiB)" in out
    assert "is already empty" in out
