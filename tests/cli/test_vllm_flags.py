"""vLLM's command-line flags mean what they mean in ``vllm serve`` (table-driven), and every default shows in --help."""

from __future__ import annotations

import argparse

import pytest

from pagedkv.cli.engine_args import engine_config, human_int, take_positional_model
from pagedkv.cli.main import build_parser
from pagedkv.core.errors import ConfigError


def _parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def _config(*argv: str):
    args = _parse(*argv)
    take_positional_model(args)
    return engine_config(args), args


GiB = 2**30

# (command line, where to look, expected): "config.X" reads the EngineConfig, "args.X" the parsed flags
FLAGS = [
    (["serve", "org/model"], "config.model", "org/model"),
    (["serve", "org/model", "--model", "org/model"], "config.model", "org/model"),
    (["serve", "--dtype", "auto"], "config.dtype", "auto"),
    (["run", "--dtype", "auto"], "config.dtype", "auto"),
    (["serve"], "config.dtype", "auto"),  # vLLM's default: decided by the engine from the checkpoint and backend
    (["run"], "config.dtype", "auto"),
    (["serve", "--swap-space", "4"], "config.swap_space", 4 * GiB),
    (["serve", "--swap-space", "0.5"], "config.swap_space", GiB // 2),
    (["run", "--swap-space", "512MiB"], "config.swap_space", 512 * 2**20),
    (["serve", "--enable-chunked-prefill"], "args.enable_chunked_prefill", True),
    (["serve", "--max-model-len", "32k"], "config.max_model_len", 32000),
    (["serve", "--max-model-len", "32K"], "config.max_model_len", 32768),
    (["serve", "--max-model-len", "25.6k"], "config.max_model_len", 25600),
    (["serve", "--max-model-len", "auto"], "config.max_model_len", "auto"),
    (["serve", "--max-model-len", "-1"], "config.max_model_len", "auto"),
    (["run", "--max-model-len", "4096"], "config.max_model_len", 4096),
    (["serve", "--served-model-name", "a", "b"], "args.served_model_name", ["a", "b"]),
    (["serve"], "args.generation_config", "auto"),
    (["serve", "--generation-config", "vllm"], "args.generation_config", "vllm"),
    (["serve", "--chat-template", "t.jinja"], "args.chat_template", "t.jinja"),
    (["serve", "--max-logprobs", "5"], "args.max_logprobs", 5),
    (["serve", "--kv-cache-memory-bytes", "1000000"], "config.kv_cache_memory", 1000000),
    (["run", "--kv-cache-memory", "1M"], "config.kv_cache_memory", 2**20),
    (["serve", "--num-gpu-blocks-override", "77"], "config.num_blocks", 77),
    (["serve", "--enforce-eager"], "args.enforce_eager", True),
    (["serve"], "config.enable_prefix_caching", True),
    (["serve", "--no-enable-prefix-caching"], "config.enable_prefix_caching", False),
    (["run", "--no-enable-prefix-caching"], "config.enable_prefix_caching", False),
    (["run", "--enable-prefix-caching"], "config.enable_prefix_caching", True),
    (["serve", "--scheduler", "spf"], "config.scheduler", "spf"),
    (["run", "--scheduling-policy", "priority"], "config.scheduler", "priority"),
    (["serve"], "config.scheduler", "fcfs"),
    (["serve", "--plugin-option", "telemetry.keyframe_steps=10", "--plugin-option", "telemetry.name=x"],
     "config.plugin_options", {"telemetry": {"keyframe_steps": 10, "name": "x"}}),
    (["serve", "--metrics-prefix", "vllm"], "args.metrics_prefix", "vllm"),
    (["serve", "--quantization", "gguf"], "config.quantization", "gguf"),
    (["run", "-q", "GGUF"], "config.quantization", "gguf"),
    (["run"], "config.quantization", None),
    (["run", "-q", "int8"], "config.quantization", "int8"),
    (["serve", "--quantization", "INT4"], "config.quantization", "int4"),
    (["serve", "--enable-prompt-tokens-details"], "args.enable_prompt_tokens_details", True),
    (["serve"], "args.structured_outputs_allow_additional_properties", False),
    (["serve", "--structured-outputs-allow-additional-properties"],
     "args.structured_outputs_allow_additional_properties", True),
]


@pytest.mark.parametrize(("argv", "where", "expected"), FLAGS, ids=[" ".join(f[0]) for f in FLAGS])
def test_flag_means_what_vllm_means(argv, where, expected):
    config, args = _config(*argv)
    kind, name = where.split(".")
    assert getattr(config if kind == "config" else args, name) == expected


@pytest.mark.parametrize(("argv", "message"), [
    (["serve", "--no-enable-chunked-prefill"], "always runs chunked prefill"),
    (["serve", "--max-model-len", "1.5K"], "decimals"),
    (["serve", "--max-model-len", "lots"], "invalid integer"),
    (["serve", "--plugin-option", "novalue"], "plugin.key=value"),
    (["serve", "--swap-space", "4 parsecs"], "size"),
])
def test_bad_flags_are_one_clear_argparse_error(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        _parse(*argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "message"), [
    (["serve", "a/b", "--model", "c/d"], "given twice"),
    (["serve", "--scheduler", "spf", "--scheduling-policy", "priority"], "disagree"),
    (["serve", "--quantization", "awq"], "quantization 'awq' is not implemented"),
    (["run", "--quantization", "gguf", "--model-impl", "transformers"], "runs pagedkv's own Llama"),
    (["serve", "--quantization", "int4-g128"], "group 128 needs a block format"),
    (["serve", "--quantization", "int8", "--tensor-parallel-size", "2"], "quantization int8 runs pagedkv's own"),
])
def test_contradictions_are_config_errors(argv, message):
    with pytest.raises(ConfigError, match=message):
        _config(*argv)


def test_human_int_reads_as_vllm():
    assert [human_int(t) for t in ("1k", "1K", "2m", "2M", "7")] == [1000, 1024, 2 * 10**6, 2 * 2**20, 7]


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[name]


@pytest.mark.parametrize("command", ["run", "serve"])
def test_every_default_shows_in_help(command):
    parser = _subparser(command)
    missing = []
    for action in parser._actions:
        if not action.option_strings or action.default in (None, argparse.SUPPRESS, [], False) or action.help is None:
            continue
        shown = parser._get_formatter()._expand_help(action) if action.help else ""
        if "default" not in shown and str(action.default) not in shown and "%(default)" not in action.help:
            missing.append(action.option_strings[0])
    assert missing == []
    text = parser.format_help()
    for flag in ("--max-tokens", "--temperature", "--seed", "--block-size") if command == "run" else ("--port",
                                                                                                     "--block-size"):
        if command == "run" or flag != "--max-tokens":
            assert flag in text
    assert "(default: 16)" in text  # --block-size
