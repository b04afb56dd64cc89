"""The command line: every flag documented with its default, every engine setting a flag, and
`nori-jax --help` without JAX."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys

import pytest

from nori_jax.cli import build_parser
from nori_jax.cli_parsing import walk_parsers
from nori_jax.core.scheduler_config import SchedulerConfig
from nori_jax.distributed_config import DistributedConfig
from nori_jax.engine_args import engine_config_from_args, engine_flags, engine_overrides
from nori_jax.engine_config import EngineConfig
from nori_jax.mesh_config import MeshConfig

# The load generator's own flags are documented by its module (nori_jax/bench/); of `bench`, only
# the engine flags that `bench offline` shares are checked here.
BENCH = ("bench",)
BENCH_OFFLINE = ("bench", "offline")


def _commands() -> dict[tuple[str, ...], argparse.ArgumentParser]:
    return dict(walk_parsers(build_parser()))


def _options(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if action.option_strings and not isinstance(action, argparse._HelpAction):
            yield action


def test_every_command_is_reachable():
    names = {" ".join(path) for path in _commands()}
    for cmd in ("generate", "chat", "serve", "bench serve", "bench offline", "cache clear"):
        assert cmd in names


def test_every_flag_has_a_help_line_with_its_default():
    engine_dests = {f.dest for f in engine_flags()}
    checked = 0
    for path, parser in _commands().items():
        formatter = parser._get_formatter()
        for action in _options(parser):
            if path[:1] == BENCH and (path != BENCH_OFFLINE or action.dest not in engine_dests):
                continue
            where = f"{' '.join(path) or 'nori-jax'} {action.option_strings[0]}"
            assert action.help and action.help.strip(), f"{where} has no help"
            shown = formatter._expand_help(action)
            has_default = action.default not in (None, False, argparse.SUPPRESS)
            if action.dest in engine_dests or has_default:
                assert "default" in shown, f"{where}: the help does not state the default"
            checked += 1
    assert checked > 100


def test_every_engine_setting_is_a_flag():
    flagged = {(f.section, f.field.name) for f in engine_flags()}
    for section, cls in (
        (None, EngineConfig),
        ("scheduler", SchedulerConfig),
        ("mesh", MeshConfig),
        ("distributed", DistributedConfig),
    ):
        for field in dataclasses.fields(cls):
            if section is None and field.name in ("scheduler", "mesh", "distributed"):
                continue
            assert (section, field.name) in flagged, field.name


def _parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["generate", "--prompt", "x", *argv])


def test_flags_set_only_what_they_name():
    args = _parse(
        "--max-num-seqs", "8", "--no-prefix-caching", "--tp", "2", "--max-num-waiting", "none",
        "--sync-scheduling", "--dtype", "float32",
    )  # fmt: skip
    assert engine_overrides(args) == {
        "dtype": "float32",
        "async_scheduling": False,
        "scheduler": {"max_num_seqs": 8, "enable_prefix_caching": False, "max_num_waiting": None},
        "mesh": {"model": 2},
    }
    assert engine_overrides(_parse()) == {}


def test_flags_override_the_preset():
    cfg = engine_config_from_args(_parse("--config", "tiny-cpu", "--max-num-seqs", "4"))
    assert cfg == EngineConfig.from_preset("tiny-cpu", {"max_num_seqs": 4})
    # vLLM's flag names
    cfg = engine_config_from_args(
        _parse("--gpu-memory-utilization", "0.5", "--max-num-batched-tokens", "512",
               "--tensor-parallel-size", "1", "--max-model-len", "1024")
    )  # fmt: skip
    assert cfg.gpu_memory_utilization == 0.5 and cfg.scheduler.max_num_batched_tokens == 512
    assert cfg.scheduler.max_model_len == 1024 and not cfg.scheduler.clamp_max_model_len


@pytest.mark.parametrize("argv", [["--max-num-seqs", "many"], ["--dtype", "int4"]])
def test_bad_flag_values_are_refused_by_the_parser(argv, capsys):
    with pytest.raises(SystemExit):
        _parse(*argv)
    assert "invalid" in capsys.readouterr().err


def test_top_level_help_imports_no_jax():
    code = (
        "import sys\n"
        "from nori_jax.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax'))\n"
        "assert not heavy, heavy\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "generate" in r.stdout and "chat" in r.stdout and "serve" in r.stdout


def test_generate_refuses_a_bad_min_p_before_starting_an_engine():
    from nori_jax.generate_cli import run_generate

    assert _parse("--min-p", "0.1").min_p == 0.1
    with pytest.raises(ValueError, match="min_p=2.0"):
        run_generate(_parse("--min-p", "2"))


def test_attention_tuning_is_read_as_written_and_refused_by_name_at_parse():
    """--attention-tuning reaches the config as its text; a malformed one is a ValueError of the
    config (before any model or engine), as is one beside the reference backend."""
    text = "tokens<2048: prefill_interleave=per_step,pingpong=true"
    cfg = engine_config_from_args(_parse("--config", "tiny-cpu", "--attention-tuning", text))
    assert cfg.attention_tuning == text
    with pytest.raises(ValueError, match="selector 'tokens<=2048' must be tokens<N or tokens>=N"):
        engine_config_from_args(_parse("--attention-tuning", "tokens<=2048: pingpong=true"))
    with pytest.raises(ValueError, match="attention_backend='reference' has none"):
        engine_config_from_args(
            _parse("--attention-backend", "reference", "--attention-tuning", "pingpong=true")
        )


def test_generate_prints_each_prompts_samples(capsys):
    """--n 2: each text after its `[prompt i, sample j]` line, sample j seeded with the seed + j
    (so sample 1 of seed 5 is sample 0 of seed 6); --n 0 is refused before an engine starts."""
    from nori_jax.generate_cli import run_generate

    with pytest.raises(ValueError, match="n=0"):
        run_generate(_parse("--n", "0"))

    def stdout(seed: int, n: int) -> str:
        argv = ["generate", "--prompt", "ab", "--config", "tiny-cpu", "--max-tokens", "6"]
        argv += ["--temperature", "1", "--ignore-eos", "--sampling-seed", str(seed), "--n", str(n)]
        capsys.readouterr()
        assert run_generate(build_parser().parse_args(argv)) == 0
        return capsys.readouterr().out

    first, second = stdout(5, 1), stdout(6, 1)
    assert first != second
    assert stdout(5, 2) == f"[prompt 0, sample 0]\n{first}[prompt 0, sample 1]\n{second}"


def test_generate_logprobs_lines_and_bound():
    from nori_jax.core.outputs import RequestOutput
    from nori_jax.generate_cli import logprob_lines, run_generate

    with pytest.raises(ValueError, match="logprobs=21"):
        run_generate(_parse("--logprobs", "21"))  # refused before an engine starts

    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return {7: "a", 8: "b", 9: "c"}[ids[0]]

    out = RequestOutput("r", None, [1], [], "", None, True, "length", token_ids=[7, 8])
    out.logprobs = [-0.5, -1.0]
    assert logprob_lines(Tok(), out) == "  'a'\t-0.5000\n  'b'\t-1.0000"
    out.top_logprobs = [[(7, -0.5), (9, -2.0)], [(9, -0.25), (8, -1.0)]]
    assert logprob_lines(Tok(), out).splitlines() == [
        "  'a'\t-0.5000\t| 'a' -0.5000, 'c' -2.0000",
        "  'b'\t-1.0000\t| 'c' -0.2500, 'b' -1.0000",
    ]
    assert logprob_lines(None, out).startswith("  <7>\t-0.5000")


def test_generate_prompt_logprob_lines_and_bound():
    """--prompt-logprobs: a line per prompt token (the first has no logprob) and the prompt's
    summed logprob, its log-likelihood; 21 is refused before an engine starts."""
    from nori_jax.core.outputs import RequestOutput
    from nori_jax.generate_cli import prompt_logprob_lines, run_generate

    with pytest.raises(ValueError, match="prompt_logprobs=21"):
        run_generate(_parse("--prompt-logprobs", "21"))

    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return {7: "a", 8: "b", 9: "c"}[ids[0]]

    out = RequestOutput("r", None, [7, 8, 9], [], "", None, True, "length", token_ids=[])
    out.prompt_logprobs = [None, -1.5, -0.25]
    assert prompt_logprob_lines(Tok(), out).splitlines() == [
        "  'a'\t-",
        "  'b'\t-1.5000",
        "  'c'\t-0.2500",
        "  prompt logprob sum -1.7500",
    ]
    out.prompt_top_logprobs = [None, [(9, -0.5)], [(9, -0.25)]]
    assert prompt_logprob_lines(Tok(), out).splitlines()[1] == "  'b'\t-1.5000\t| 'c' -0.5000"


def test_ctrl_c_in_a_command_without_its_own_handling_ends_without_a_traceback(monkeypatch, capsys):
    """A KeyboardInterrupt that reaches main (plan sweep, generate mid-run) printed a traceback of
    30 lines; it ends with "interrupted" and the shell's code for SIGINT."""
    from nori_jax import cli

    def interrupted(args):
        raise KeyboardInterrupt

    parser = cli.build_parser()
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    args = parser.parse_args(["cache", "info"])
    monkeypatch.setattr(args, "func", interrupted, raising=False)
    monkeypatch.setattr(parser, "parse_args", lambda argv=None: args)
    assert cli.main(["cache", "info"]) == 130
    assert capsys.readouterr().err.strip() == "interrupted"
