"""The OpenAI door's two wrong-ids repros (issue 45), against a real daemon and the official client: every
request is fed exactly a whole render's ids, and its greedy answer equals a fresh daemon's.

The fresh daemon is sent the same requests, longest first: none of them continues a remembered request
(each is a prefix of the one before, not an extension), so each is rendered and encoded whole there
(checked by its counters), and the cache it restores is a prefix of its own ids.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from conftest import RunningDaemon, running_daemon
from daemon.engine.running import Answer
from daemon.models.builtin import ensure_builtin
from daemon.prompt import conversation_ids
from test_renders import reordered

pytestmark = pytest.mark.anyio

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
QWEN3_TOKENS = ["<tool_call>", "</tool_call>", "<think>", "</think>", "<tool_response>", "</tool_response>"]
ADD_TOOL: dict[str, Any] = {"type": "function", "function": {
    "name": "add", "description": "Add two numbers.",
    "parameters": {"type": "object", "required": ["a", "b"],
                   "properties": {"a": {"type": "number", "description": "the first"},
                                  "b": {"type": "number", "description": "the second"}}}}}


def fed_ids(d: RunningDaemon) -> list[list[int]]:
    """The prompt ids of every job the daemon's engine is handed from now on, as it is handed them."""
    fed: list[list[int]] = []
    submit = d.daemon.engine.submit

    def recording(answer: Answer) -> None:
        fed.append(list(answer.tokens))
        submit(answer)

    d.daemon.engine.submit = recording  # type: ignore[method-assign]
    return fed


def _qwen3_model(root: Path) -> Path:
    """builtin:tiny with Qwen3's official chat template and its added tokens (random weights for them)."""
    out = root / "tiny-qwen3"
    shutil.copytree(ensure_builtin("builtin:tiny", root / "models"), out)
    config = json.loads((out / "config.json").read_text())
    tok = json.loads((out / "tokenizer.json").read_text())
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    first = config["vocab_size"]
    for i, content in enumerate(QWEN3_TOKENS):
        token = {"id": first + i, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
                 "normalized": False, "special": False}
        tok["added_tokens"].append(token)
        tok_config["added_tokens_decoder"][str(first + i)] = {k: v for k, v in token.items() if k != "id"}
    tok_config["chat_template"] = (TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text(encoding="utf-8")
    (out / "tokenizer.json").write_text(json.dumps(tok))
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config))
    config["vocab_size"] = first + len(QWEN3_TOKENS)
    config.pop("kvd_builtin", None)
    (out / "config.json").write_text(json.dumps(config))
    weights = {k: np.array(v) for k, v in mx.load(str(out / "model.safetensors")).items()}  # type: ignore[union-attr]
    rng = np.random.default_rng(45)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        old = weights[name]
        weights[name] = np.concatenate([old, rng.normal(0, float(old.std()), (len(QWEN3_TOKENS), old.shape[1]))
                                        .astype(old.dtype)])
    mx.save_safetensors(str(out / "model.safetensors"), {k: mx.array(v) for k, v in weights.items()})
    return out


async def _answers(data_dir: Path, model: str, requests: list[dict[str, Any]]) -> tuple[list[str], Any]:
    """Each request's greedy answer from a daemon, checking that each was fed exactly a whole render's ids;
    and the daemon's renders (its counters)."""
    import openai

    async with running_daemon(data_dir, model=model) as d:
        fed = fed_ids(d)
        api = openai.AsyncOpenAI(base_url=d.url.replace("ws://", "http://"), api_key=d.token, max_retries=0)
        answers = []
        for request in requests:
            reply = await api.chat.completions.create(model=model, max_tokens=8, temperature=0, **request)
            answers.append(reply.choices[0].message.content or "")
        await api.close()
        tokenizer = d.daemon.engine.tokenizer
        for ids, request in zip(fed, requests, strict=True):
            system = next((m["content"] for m in request["messages"] if m["role"] == "system"), None)
            messages = [_as_transcript(m) for m in request["messages"] if m["role"] != "system"]
            assert ids == conversation_ids(tokenizer, messages, system, request.get("tools"))
        return answers, d.daemon.turns.renders


def _as_transcript(m: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI message as the transcript keeps it (what prompt.template_message takes)."""
    out = {"role": m["role"], "content": m.get("content") or ""}
    if m.get("tool_calls"):
        out["tool_calls"] = [{"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                             for c in m["tool_calls"]]
    if m.get("tool_call_id"):
        out["tool_call_id"] = m["tool_call_id"]
    return out


async def _same_as_a_fresh_daemon(tmp_path: Path, model: str, requests: list[dict[str, Any]],
                                  appended: int) -> None:
    answers, renders = await _answers(tmp_path / "kvd", model, requests)
    assert renders.appended == appended, (renders.whole, renders.appended)
    fresh, whole = await _answers(tmp_path / "fresh", model, requests[::-1])
    assert (whole.whole, whole.appended) == (len(requests), 0)
    assert answers == fresh[::-1]


async def test_a_follow_up_whose_tools_keys_come_in_another_order_is_fed_its_own_render(tmp_path: Path) -> None:
    """builtin:tiny's template prints `tool | tojson`, in the client's key order."""
    system = {"role": "system", "content": "You add numbers."}
    convo: list[dict[str, Any]] = [system, {"role": "user", "content": "What is 1 + 2? " * 8}]
    requests = []
    tools = [ADD_TOOL]
    for turn, follow_up in enumerate(["And 2 + 2?", "And 3 + 3?", "Thanks. And 4 + 4?", "Bye."]):
        requests.append({"messages": list(convo), "tools": tools})
        convo += [{"role": "assistant", "content": f"It is {turn}."}, {"role": "user", "content": follow_up}]
        if turn % 2 == 0:  # the parameters' keys reversed (the door keeps the other fields in its own order)
            tools = [{**tools[0], "function": {**tools[0]["function"],
                                               "parameters": reordered(tools[0]["function"]["parameters"])}}]
    assert requests[1]["tools"] == requests[0]["tools"]
    assert json.dumps(requests[1]["tools"]) != json.dumps(requests[0]["tools"])
    # Request 1 comes with the keys reversed and renders whole; 2 (as 1) continues 1's render; 3, in the
    # first order again, continues the first request's (its tools and its first message).
    await _same_as_a_fresh_daemon(tmp_path, "builtin:tiny", requests, appended=2)


async def test_qwen3s_template_with_tool_results_as_user_messages_and_thinking_in_content(
        tmp_path: Path) -> None:
    """Qwen3's template keeps the thinking of the answers after its last query, and a user message that wraps
    `<tool_response>` is no query: sending one keeps earlier thinking, a real question strips it."""
    model = str(_qwen3_model(tmp_path))
    think = "<think>\nThe user wants a sum, so I call add.\n</think>\n\nLet me add."

    def call(n: int) -> dict[str, Any]:
        return {"id": f"call_{n}", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}

    convo: list[dict[str, Any]] = [{"role": "user", "content": "What is 1 + 2?"}]
    requests = [{"messages": list(convo)}]
    convo += [{"role": "assistant", "content": think, "tool_calls": [call(1)]},
              {"role": "user", "content": "<tool_response>\n3\n</tool_response>"}]
    requests.append({"messages": list(convo)})  # after the last query: the answer keeps its thinking
    convo += [{"role": "assistant", "content": "<think>\nIt is 3.\n</think>\n\nIt is 3."},
              {"role": "user", "content": "And 2 + 2?"}]
    requests.append({"messages": list(convo)})  # a new query: the earlier answers' thinking goes
    convo += [{"role": "assistant", "content": think, "tool_calls": [call(2)]},
              {"role": "user", "content": "<tool_response>\n4\n</tool_response>"}]
    requests.append({"messages": list(convo)})
    convo += [{"role": "assistant", "content": "<think>\nFour.\n</think>\n\nIt is 4."},
              {"role": "user", "content": "Thanks."}]
    requests.append({"messages": list(convo)})
    await _same_as_a_fresh_daemon(tmp_path, model, requests, appended=4)


async def test_qwen3s_template_is_fed_the_reasoning_a_client_sends_back(tmp_path: Path) -> None:
    """vLLM-style clients send an answer's reasoning back as `reasoning_content` (its text apart from the
    content); Qwen3's template puts it in `<think>` where it keeps thinking. Each request is fed exactly the
    template's own render of the messages as the client sent them."""
    import openai

    model = str(_qwen3_model(tmp_path))

    def call(n: int) -> dict[str, Any]:
        return {"id": f"call_{n}", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}

    convo: list[dict[str, Any]] = [{"role": "user", "content": "What is 1 + 2?"}]
    requests = [list(convo)]
    convo += [{"role": "assistant", "content": "Let me add.", "reasoning_content": "The user wants a sum.",
               "tool_calls": [call(1)]},
              {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
    requests.append(list(convo))  # after the last query: the answer keeps its reasoning, in <think>
    convo += [{"role": "assistant", "content": "It is 3.", "reasoning": "The tool says 3."},  # vLLM's newer name
              {"role": "user", "content": "And 2 + 2?"}]
    requests.append(list(convo))  # a new query: the earlier answers' reasoning goes
    convo += [{"role": "assistant", "content": "", "reasoning_content": "Add again.", "tool_calls": [call(2)]},
              {"role": "tool", "tool_call_id": "call_2", "content": "4"}]
    requests.append(list(convo))
    async with running_daemon(tmp_path / "kvd", model=model) as d:
        fed = fed_ids(d)
        async with openai.AsyncOpenAI(base_url=d.url.replace("ws://", "http://"), api_key=d.token,
                                      max_retries=0) as api:
            for messages in requests:
                await api.chat.completions.create(model=model, max_tokens=4, temperature=0,
                                                  tools=[ADD_TOOL],  # type: ignore[list-item]
                                                  messages=messages)  # type: ignore[arg-type]
        tokenizer = d.daemon.engine.tokenizer
        for ids, messages in zip(fed, requests, strict=True):
            text = tokenizer.apply_chat_template(messages, tools=[ADD_TOOL], add_generation_prompt=True,
                                                 tokenize=False)
            assert ids == tokenizer.encode(text, add_special_tokens=False)
        assert "<think>\nThe user wants a sum.\n</think>" in tokenizer.decode(fed[1])


async def test_anthropic_thinking_and_responses_reasoning_reach_qwen3s_template_as_reasoning_content(
        tmp_path: Path) -> None:
    """An Anthropic assistant message's `thinking` block, and a Responses `reasoning` item before the calls it
    made, are fed as the chat door's `reasoning_content` is: the template's own render of the same
    conversation with it."""
    import anthropic
    import openai

    model = str(_qwen3_model(tmp_path))
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    same: list[dict[str, Any]] = [
        {"role": "user", "content": "What is 1 + 2?"},
        {"role": "assistant", "content": "Let me add.", "reasoning_content": "A sum: call add.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
    async with running_daemon(tmp_path / "kvd", model=model) as d:
        fed = fed_ids(d)
        base = d.url.replace("ws://", "http://").removesuffix("/v1")
        async with anthropic.AsyncAnthropic(base_url=base, api_key=d.token, max_retries=0) as claude:
            await claude.messages.create(model=model, max_tokens=4, messages=[
                {"role": "user", "content": "What is 1 + 2?"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "A sum: call add.", "signature": "kvd-ignores-it"},
                    {"type": "text", "text": "Let me add."},
                    {"type": "tool_use", "id": "call_1", "name": "add", "input": {"a": 1, "b": 2}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": "3"}]}])
        async with openai.AsyncOpenAI(base_url=base + "/v1", api_key=d.token, max_retries=0) as api:
            await api.responses.create(model=model, max_output_tokens=4, store=False, input=[
                {"role": "user", "content": "What is 1 + 2?"},
                {"type": "reasoning", "id": "rs_1", "summary": [],
                 "content": [{"type": "reasoning_text", "text": "A sum: call add."}]},
                {"role": "assistant", "content": "Let me add."},
                {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": '{"a": 1, "b": 2}'},
                {"type": "function_call_output", "call_id": "call_1", "output": "3"}])
        tokenizer = d.daemon.engine.tokenizer
        text = tokenizer.apply_chat_template(same, add_generation_prompt=True, tokenize=False)
        assert "<think>\nA sum: call add.\n</think>" in text
        assert fed == [tokenizer.encode(text, add_special_tokens=False)] * 2
