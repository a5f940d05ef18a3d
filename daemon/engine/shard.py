"""A model's share for this rank: mlx-lm's tensor parallelism (`model.shard(group)`).

Each rank keeps 1/N of every attention and MLP projection, so 1/N of the
heads and of every KV cache; two all_sums per layer make each forward whole
again on every rank. mlx-lm splits heads evenly, so a model whose heads do
not divide by N is refused before anything starts (SmolLM2's 3 KV heads run
on 1 or 3 ranks).
"""

from __future__ import annotations

from typing import Any


class ShardError(Exception):
    """The model cannot be split across this many ranks; the message says which counts would do."""


def heads(config: dict[str, Any]) -> tuple[int, int]:
    """(attention heads, KV heads) from a model's config.json (text_config for multimodal ones)."""
    c = config.get("text_config") or config
    q = int(c.get("num_attention_heads") or 0)
    return q, int(c.get("num_key_value_heads") or q)


def check_shardable(name: str, config: dict[str, Any], ranks: int) -> None:
    """Raise ShardError unless both head counts divide by `ranks`."""
    if ranks <= 1:
        return
    q, kv = heads(config)
    if not q:
        raise ShardError(f"{name}: its config.json gives no head count; it cannot be split across ranks")
    if q % ranks or kv % ranks:
        fits = [n for n in range(1, kv + 1) if q % n == 0 and kv % n == 0]
        raise ShardError(f"{name} has {q} attention heads and {kv} KV heads, which do not divide by "
                         f"{ranks} ranks; run it on {' or '.join(map(str, fits))} rank(s)")


def shard(name: str, loaded: Any, group: Any) -> None:
    """Keep this rank's share of `loaded.model` (modelload.Loaded), in place."""
    import mlx.core as mx

    check_shardable(name, loaded.config, group.size())
    model = loaded.model
    if not hasattr(model, "shard"):
        raise ShardError(f"mlx-lm cannot shard {getattr(model, 'model_type', type(model).__name__)} models "
                         "(no model.shard); run it on one rank")
    model.shard(group)
    mx.eval(model.parameters())
