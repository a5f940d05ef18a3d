"""A model that calls a tool: builtin:tiny's files, with weights set so greedy decoding is a script.

Random weights never write a tool call, and no real model here calls tools,
so the tool-calling tests use this: builtin:tiny (its chat template has
Qwen's tool calling) with one added token, CALL, whose text is a whole call
in Qwen's format, and weights that make the model a bigram machine:

- every layer's output projections are zero, so each position's hidden state
  is its own token's embedding (attention and MLPs add nothing);
- the embedding of the generation prompt's last token ("\\n" after
  "<|im_start|>assistant") points at CALL in the output head, and CALL's
  embedding points at <|im_end|>; every other embedding is zero (all logits
  equal: token 0).

So every greedy answer is CALL then <|im_end|>: one call of get_weather for
Paris. The model loads through the real mlx-lm loader and runs through
kvd's real engine; only its weights are chosen.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from daemon.models.builtin import ensure_builtin

CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather now in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def write_tool_model(root: Path) -> Path:
    """The model's folder under `root` (an mlx-lm model directory kvd serves by path)."""
    from transformers import PreTrainedTokenizerFast

    out = root / "tool-caller"
    shutil.copytree(ensure_builtin("builtin:tiny", root / "models"), out)
    config = json.loads((out / "config.json").read_text())
    tok = json.loads((out / "tokenizer.json").read_text())
    call_id = config["vocab_size"]
    tok["added_tokens"].append({"id": call_id, "content": CALL_TEXT, "single_word": False, "lstrip": False,
                                "rstrip": False, "normalized": False, "special": False})
    (out / "tokenizer.json").write_text(json.dumps(tok))
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    tok_config["added_tokens_decoder"][str(call_id)] = {k: v for k, v in tok["added_tokens"][-1].items() if k != "id"}
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config))
    config["vocab_size"] = call_id + 1
    config.pop("kvd_builtin", None)  # not the built-in model any more
    (out / "config.json").write_text(json.dumps(config))

    fast: Any = PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json"))  # type: ignore[no-untyped-call]
    newline = fast.encode("<|im_start|>assistant\n", add_special_tokens=False)[-1]
    eos = config["eos_token_id"]
    loaded: Any = mx.load(str(out / "model.safetensors"))
    weights = {k: np.array(v) for k, v in loaded.items()}
    hidden = config["hidden_size"]
    for name in weights:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = np.zeros_like(weights[name])
    embed = np.zeros((call_id + 1, hidden), np.float32)
    head = np.zeros((call_id + 1, hidden), np.float32)
    embed[newline, 0] = 1.0  # "\n" -> CALL
    head[call_id, 0] = 1.0
    embed[call_id, 1] = 1.0  # CALL -> <|im_end|>
    head[eos, 1] = 1.0
    weights["model.embed_tokens.weight"] = embed
    weights["lm_head.weight"] = head
    weights["model.norm.weight"] = np.ones(hidden, np.float32)
    mx.save_safetensors(str(out / "model.safetensors"), {k: mx.array(v) for k, v in weights.items()})
    return out


def write_plain_model(tool_model: Path, root: Path) -> Path:
    """The tool model with a chat template that has no tool calling (plain ChatML): mlx-lm finds no call
    format in it, so a request's tools cannot be shown to it."""
    plain = shutil.copytree(tool_model, root / "plain-chatml")
    config_path = plain / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = ("{%- for message in messages -%}{{- '<|im_start|>' + message['role'] + '\\n' + "
                               "message['content'] + '<|im_end|>\\n' -}}{%- endfor -%}"
                               "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")
    config_path.write_text(json.dumps(config))
    return plain


def write_alternating_model(tool_model: Path, root: Path) -> Path:
    """The tool model with a chat template that refuses a conversation whose roles do not alternate, as
    Gemma's and Mistral's do (`raise_exception`): the template, not kvd, says what is wrong."""
    strict = shutil.copytree(tool_model, root / "alternating")
    config_path = strict / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = (
        "{%- for message in messages -%}"
        "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
        "{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') -}}"
        "{%- endif -%}"
        "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")
    config_path.write_text(json.dumps(config))
    return strict
