"""The built-in models' tokenizer: a byte-level BPE written by hand, no training.

It encodes any text exactly (all 256 byte symbols are in the vocabulary)
and has ~300 English words built by hand-written merge chains: no training,
so nothing depends on a trainer's tie-breaking. The pipeline around it is
Qwen2.5's (ChatML template, Qwen2's pre-tokenizer split).
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "CHAT_TEMPLATE",
    "EOS_TOKEN",
    "IM_START",
    "MAX_LEN",
    "PAD_TOKEN",
    "SPECIAL_TOKENS",
    "bpe_vocab_and_merges",
    "tokenizer_config",
    "tokenizer_json",
    "word_tokens",
]

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, EOS_TOKEN)
MAX_LEN = 8192

# ChatML, as Qwen2.5 uses it, minus Qwen's default system prompt; with Qwen's tool calling (the
# tools in the system turn, each call a JSON object in <tool_call> tags, results as <tool_response>
# in a user turn), so the API's tool calling runs on a built-in model (mlx-lm reads this template
# as its "json_tools" format). Without tools, plain ChatML.
CHAT_TEMPLATE = (
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages and messages[0]['role'] == 'system' -%}{{- messages[0]['content'] + '\\n\\n' -}}{%- endif -%}"
    "{{- '# Tools\\n\\nYou may call functions. Their signatures, within <tools></tools>:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nFor each call, return a JSON object with its name and arguments within "
    "<tool_call></tool_call> tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if tools and loop.first and message['role'] == 'system' -%}"
    "{%- elif message['role'] == 'tool' -%}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' -}}"
    "{%- elif message['role'] == 'assistant' and message.tool_calls is defined and message.tool_calls -%}"
    "{{- '<|im_start|>assistant\\n' + (message['content'] or '') -}}"
    "{%- for tool_call in message.tool_calls -%}"
    "{%- set tool_call = tool_call.function if tool_call.function is defined else tool_call -%}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' -}}"
    "{{- (tool_call.arguments | tojson) + '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{{- message['content'] + '<|im_end|>' + '\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)

# The 300 most common English words; each becomes a token with and without a
# leading space.
WORDS = """
the of and to in is it you that he was for on are with as his they be at one
have this from or had by not word but what some we can out other were all
there when up use your how said an each she which do their time if will way
about many then them write would like so these her long make thing see him
two has look more day could go come did number sound no most people my over
know water than call first who may down side been now find any new work part
take get place made live where after back little only round man year came
show every good me give our under name very through just form sentence great
think say help low line differ turn cause much mean before move right boy
old too same tell does set three want air well also play small end put home
read hand port large spell add even land here must big high such follow act
why ask men change went light kind off need house picture try us again
animal point mother world near build self earth father head stand own page
should country found answer school grow study still learn plant cover food
sun four between state keep eye never last let thought city tree cross farm
hard start might story saw far sea draw left late run while press close
night real life few north open seem together next white children begin got
walk example ease paper group always music those both mark often letter
until mile river car feet care second book carry took science eat room
friend began idea fish mountain stop once base hear horse cut sure watch
color face wood main enough plain girl
""".split()


def bytes_to_unicode() -> list[str]:
    """GPT-2's printable stand-in for each byte value, indexed by byte."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    table: dict[int, int] = {b: b for b in printable}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = 256 + n
            n += 1
    return [chr(table[b]) for b in range(256)]


def bpe_vocab_and_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Bytes first (ids 0-255, in byte order), then each merge's product.

    Each word gets the left-to-right chain ``(t,h) -> th, (th,e) -> the``, so
    every prefix is a token too; merges shared between words are kept once.
    All space-led chains rank before all bare ones: in a pre-token such as
    "Ġhand" the only symbol that can start with "Ġ" is the growing prefix, so
    its chain always wins and every listed word after a space encodes as one
    token. (Bare words can lose to each other, "hand" -> "h" "and"; that only
    costs a token, never exactness.)
    """
    symbols = bytes_to_unicode()
    vocab: dict[str, int] = {s: i for i, s in enumerate(symbols)}
    merges: list[tuple[str, str]] = []
    seen: set[tuple[str, str]] = set()
    space = symbols[ord(" ")]  # "Ġ"
    forms = [space + w for w in WORDS] + list(WORDS)
    for form in forms:
        left = form[0]
        for ch in form[1:]:
            pair = (left, ch)
            left = left + ch
            if pair not in seen:
                seen.add(pair)
                merges.append(pair)
            if left not in vocab:
                vocab[left] = len(vocab)
    return vocab, merges


def word_tokens() -> list[str]:
    """The tokens greedy decoding should pick: space-led whole words."""
    space = bytes_to_unicode()[ord(" ")]
    return [space + w for w in WORDS]


# Qwen2's pre-tokenizer split (GPT-4-like: words keep their leading space,
# digits are single).
QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def tokenizer_json(vocab: dict[str, int], merges: list[tuple[str, str]]) -> str:
    """Exactly Qwen2's pipeline around our vocab and merges.

    transformers 5 ignores tokenizer.json's pipeline for ``model_type:
    qwen2`` and rebuilds Qwen2Tokenizer's own (NFC, this split, ByteLevel)
    from the vocab and merges alone, while for ``gemma3_text`` it reads the
    file verbatim. Writing Qwen2's pipeline into the file makes both models,
    and the raw ``tokenizers`` library, tokenize identically. The price is
    NFC: decomposed input ("e" + U+0301) comes back composed, as with the
    real Qwen2.5.
    """
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
    )

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]
    )
    return tok.to_str(pretty=True)


def tokenizer_config(special_ids: dict[str, int]) -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "additional_special_tokens": [IM_START, EOS_TOKEN],
        "added_tokens_decoder": {
            str(i): {
                "content": t,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for t, i in special_ids.items()
        },
        "model_max_length": MAX_LEN,
        # Exact round trips: no " ." -> "." clean-up on decode.
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "errors": "replace",
        "chat_template": CHAT_TEMPLATE,
    }
