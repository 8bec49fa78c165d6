"""argparse options generated from the config dataclasses and from SamplingParams."""

from __future__ import annotations

import argparse
import dataclasses
import json
import typing
from typing import Any

from lightwell.config import CONFIG_CLASSES, EngineConfig
from lightwell.types import SamplingParams

SAMPLING_HELP = {
    "n": "Number of completions per prompt.",
    "temperature": "Sampling temperature; 0 = greedy. Unset: the model's generation_config.json "
    "value; without one, 0 in `generate` and `chat` (a small model's answers fall apart when "
    "sampled) and 1.0 through the API and the server (OpenAI's default)",
    "top_p": "Nucleus sampling: keep the smallest token set with this much probability.",
    "top_k": "Keep only the k most likely tokens (0 or -1: off).",
    "min_p": "Keep tokens with probability >= min_p x the top token's.",
    "presence_penalty": "Penalise tokens already generated (OpenAI semantics), in [-2, 2].",
    "frequency_penalty": "Penalise tokens by how often they were generated, in [-2, 2].",
    "repetition_penalty": "Divide logits of prompt/output tokens (>1 discourages repeats).",
    "logit_bias": "JSON object token id -> bias added to its logit, e.g. '{\"42\": -100}'.",
    "seed": "Per-request sampling seed (same seed, same text).",
    "stop": "Stop string (repeat the option for several); excluded from the output.",
    "stop_token_ids": "Token ids that end generation (comma-separated).",
    "include_stop_str_in_output": "Keep the matched stop string in the output text.",
    "ignore_eos": "Keep generating after the end-of-sequence token.",
    "max_tokens": "Most tokens to generate.",
    "min_tokens": "Fewest tokens to generate before EOS / stop tokens may end it.",
    "logprobs": "Return log-probabilities of the sampled token and this many alternatives.",
    "prompt_logprobs": "Return prompt log-probabilities with this many alternatives.",
    "skip_special_tokens": "Leave special tokens out of the text.",
    "spaces_between_special_tokens": "Put spaces between special tokens in the text.",
    "detokenize": "Produce text (off: token ids only).",
    "structured_outputs": "Constrain the output: a JSON object with one of json (a JSON schema), "
    "regex, choice (a list), grammar (EBNF) or json_object, e.g. "
    '\'{"choice": ["yes", "no"]}\'.',
}
# SamplingParams fields with no CLI option (pooling: set by the engine for embedding requests).
SAMPLING_SKIP = {"pooling"}
# SamplingParams fields whose CLI name differs from the field name.
SAMPLING_RENAME = {"seed": "sample_seed"}


def _base_type(hint: Any) -> Any:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Adds "(default: X)" to an option's help unless the help states its default already
    (the engine and sampling options do, some with a friendlier value than the raw one)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if "(default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One option per config field, help text from the field's metadata."""
    for cls in CONFIG_CLASSES:
        group = parser.add_argument_group(f"{cls.__name__} options")
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            _add_field(group, f.name, _base_type(hints[f.name]), f.default, f.metadata)


def add_config_args(parser: argparse.ArgumentParser, cls: type, names: tuple[str, ...]) -> None:
    """The options of some of a config class's fields (for commands that need only those)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in names:
            _add_field(parser, f.name, _base_type(hints[f.name]), f.default, f.metadata)


def _add_field(group: Any, name: str, typ: Any, default: Any, meta: Any) -> None:
    flag = "--" + name.replace("_", "-")
    help_text = meta.get("help", "")
    if typ is bool:
        group.add_argument(
            flag, action=argparse.BooleanOptionalAction, default=default, help=help_text
        )
        return
    kw: dict[str, Any] = {"default": default, "help": f"{help_text} (default: {default})"}
    if meta.get("choices"):
        kw["choices"] = meta["choices"]
    if typ in (int, float, str):
        kw["type"] = typ
    group.add_argument(flag, **kw)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    sections = {}
    for name, cls in zip(("model", "cache", "scheduler", "parallel", "device"), CONFIG_CLASSES):
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)}
        sections[name] = cls(**values)
    cfg = EngineConfig(**sections)
    cfg.validate()
    return cfg


def add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int = 256) -> None:
    """Sampling options; unset ones fall back to the model's generation_config.json defaults."""
    group = parser.add_argument_group("sampling options")
    hints = typing.get_type_hints(SamplingParams)
    for f in dataclasses.fields(SamplingParams):
        if f.name in SAMPLING_SKIP:
            continue
        flag = "--" + SAMPLING_RENAME.get(f.name, f.name).replace("_", "-")
        typ = _base_type(hints[f.name])
        default = max_tokens if f.name == "max_tokens" else None
        shown = default if f.name == "max_tokens" else f.default
        help_text = SAMPLING_HELP.get(f.name, "")
        if f.name != "temperature":
            help_text += f" (default: {shown})"
        if f.name == "stop":
            group.add_argument(flag, action="append", default=None, help=help_text)
        elif typ is bool:
            group.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
        elif typ in (int, float):
            group.add_argument(flag, type=typ, default=default, help=help_text)
        else:  # logit_bias, stop_token_ids: parsed from text
            group.add_argument(flag, type=str, default=None, help=help_text)


def sampling_overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The sampling options the user set, as SamplingParams keyword arguments."""
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(SamplingParams):
        if f.name in SAMPLING_SKIP:
            continue
        value = getattr(args, SAMPLING_RENAME.get(f.name, f.name))
        if value is not None:
            kwargs[f.name] = value
    if isinstance(kwargs.get("logit_bias"), str):
        try:
            bias = json.loads(kwargs["logit_bias"])
            kwargs["logit_bias"] = {int(k): float(v) for k, v in bias.items()}
        except (ValueError, AttributeError) as e:
            raise ValueError(f"--logit-bias must be a JSON object of id -> bias: {e}") from None
    if isinstance(kwargs.get("structured_outputs"), str):
        try:
            kwargs["structured_outputs"] = dict(json.loads(kwargs["structured_outputs"]))
        except (ValueError, TypeError) as e:
            raise ValueError(f"--structured-outputs must be a JSON object: {e}") from None
    if isinstance(kwargs.get("stop_token_ids"), str):
        try:
            kwargs["stop_token_ids"] = [int(t) for t in kwargs["stop_token_ids"].split(",") if t]
        except ValueError:
            raise ValueError("--stop-token-ids must be comma-separated integers") from None
    return kwargs
