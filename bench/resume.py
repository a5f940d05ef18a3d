"""Resume benchmark: what a restored cache saves against re-reading the conversation.

Run: .venv/bin/python bench/resume.py [--lengths 1024 4096] [--new 32]

A Qwen2.5-0.5B-shaped model (24 layers, 14 heads, 2 KV heads, hidden 896,
float32, random weights: speed does not depend on the values), served the way
the daemon serves it: kvd's own cachestore (SessionCaches) for the tiers and
the disk format, and the engine's own prefill (daemon/engine/prefill.py: chunks of
512, the first token sampled from the last chunk's logits).

For each conversation length it prints the time to first token of the next
turn (history + a new message) after: a full re-prefill; a restore from each
tier (resident, warm, disk); and a restore from disk by a fresh SessionCaches
(a daemon restart), plus restore bandwidth beside a plain read of the same
bytes, and bytes written per turn against the new tokens' KV bytes.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from daemon.service.blas import preload_blas  # noqa: E402
from shapes import QWEN25_05B  # noqa: E402

BLAS = preload_blas()

import mlx.core as mx  # noqa: E402
from mlx_lm.models import qwen2  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from cachestore.segments import read_segment  # noqa: E402
from cachestore.snapshot import restore  # noqa: E402
from cachestore.store import Budgets, SessionCaches  # noqa: E402
from daemon.engine.prefill import Prefill  # noqa: E402
from daemon.engine.prefill import first_token as decode_first  # noqa: E402

KEY = "0123456789abcdef"
PREFILL_STEP = 512  # config.toml's default prefill_step_size
GIB = 1 << 30


def greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


def make_budgets(resident: int = 64 * GIB, warm: int = 64 * GIB, disk: int = 64 * GIB) -> Budgets:
    return Budgets(resident_bytes=resident, warm_bytes=warm, disk_bytes=disk,
                   resident_idle=3600.0, warm_idle=3600.0, max_segments=16)


def build_model() -> Any:
    mx.random.seed(0)
    model = qwen2.Model(qwen2.ModelArgs.from_dict(QWEN25_05B))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


def first_token(model: Any, prompt: list[int], cache: list[Any] | None, cached: int) -> tuple[float, list[Any]]:
    """Seconds from a restored cache to the first token, as the engine does it; and the cache
    afterwards (it holds `prompt`: the first token is not fed yet)."""
    if cache is None:
        cache, cached = make_prompt_cache(model), 0
    t0 = time.perf_counter()
    pre = Prefill(model, cache, prompt, cached, step=PREFILL_STEP)
    while (logprobs := pre.advance()) is None:
        pass
    decode_first(logprobs, greedy)
    return time.perf_counter() - t0, pre.cache


def segment_files(root: Path) -> list[Path]:
    return sorted(p for p in (root / "segments").rglob("*.safetensors"))


def drop_page_cache() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def run(model: Any, n: int, new: int, kv_per_token: int) -> dict[str, Any]:
    rng = __import__("random").Random(n)
    history = [rng.randrange(1000, 150000) for _ in range(n)]
    prompt = history + [rng.randrange(1000, 150000) for _ in range(new)]
    out: dict[str, Any] = {"n": n}

    full, cache = first_token(model, prompt, None, 0)
    out["full"] = full
    # The cache now holds the prompt; rewind it to the history alone.
    from cachestore.snapshot import rewind
    assert rewind(cache, len(prompt) - n)

    with tempfile.TemporaryDirectory(dir=os.environ.get("KVD_BENCH_DIR")) as tmp:
        root = Path(tmp)
        big = make_budgets()
        caches = SessionCaches(root, "bench", big)
        current = cache
        for tier, budgets in (("resident", big),
                              ("warm", make_budgets(resident=0)),
                              ("disk", make_budgets(resident=0, warm=0))):
            caches.budgets = budgets
            caches.resident.budget, caches.warm.budget = budgets.resident_bytes, budgets.warm_bytes
            caches.checkin(KEY, current, history)  # only the first writes to disk
            got = caches.checkout(KEY, prompt)
            assert got.restored_from == tier and got.tokens == n, (tier, got.restored_from, got.tokens)
            t, after = first_token(model, prompt, got.cache, got.tokens)
            out[tier] = got.restore_ms / 1000 + t
            out[f"{tier}_restore"] = got.restore_ms / 1000
            assert rewind(after, new)
            current = after  # back to the history alone, for the next tier
        caches.close()

        # A restart: a new SessionCaches finds the session only on disk.
        cold = drop_page_cache()
        restarted = SessionCaches(root, "bench", make_budgets(resident=0, warm=0))
        got = restarted.checkout(KEY, prompt)
        assert got.restored_from == "disk" and got.tokens == n
        t, after = first_token(model, prompt, got.cache, got.tokens)
        out["restart"] = got.restore_ms / 1000 + t
        out["restart_restore"] = got.restore_ms / 1000
        out["restart_cold"] = cold

        # Restore bandwidth: read + verify + load + restore, beside a plain read of the same bytes.
        (row,) = restarted.index.chain(KEY)
        nbytes = row.path.stat().st_size
        drop_page_cache()  # both reads start cold (when allowed), so neither warms the other
        t0 = time.perf_counter()
        data = row.path.read_bytes()
        plain = time.perf_counter() - t0
        del data
        drop_page_cache()
        t0 = time.perf_counter()
        live = restore(read_segment(row.path, checksum=row.checksum, fingerprint="bench"))
        mx.eval([c.state for c in live])
        restored = time.perf_counter() - t0
        out["plain_mbps"] = nbytes / plain / 1e6
        out["restore_mbps"] = nbytes / restored / 1e6

        # A turn of `new` tokens plus a 64-token answer writes only its own tokens.
        turn = prompt + [rng.randrange(1000, 150000) for _ in range(64)]
        t, after = first_token(model, turn, live, n)  # `after` holds exactly `turn`
        before = restarted.disk_stats.bytes_written
        restarted.checkin(KEY, after, turn)
        out["turn_written"] = restarted.disk_stats.bytes_written - before
        out["turn_kv"] = (len(turn) - n) * kv_per_token
        restarted.close()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--new", type=int, default=32, help="tokens in the new message")
    args = parser.parse_args()
    print(f"# {BLAS.reason}", file=sys.stderr)
    model = build_model()
    a = QWEN25_05B
    head_dim = a["hidden_size"] // a["num_attention_heads"]
    kv_per_token = a["num_hidden_layers"] * 2 * a["num_key_value_heads"] * head_dim * 4
    print(f"# Qwen2.5-0.5B-shaped, float32, KV {kv_per_token / 1024:.0f} KiB/token, "
          f"new message {args.new} tokens", file=sys.stderr)
    rows = [run(model, n, args.new, kv_per_token) for n in args.lengths]

    print(f"Time to first token of a turn adding {args.new} tokens to a history of N tokens:")
    print()
    print("| N | full re-prefill | resident | warm | disk | after restart | TTFT speed-up (restart) "
          "| restore alone vs re-prefill |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['n']} | {r['full']:.2f} s | {r['resident'] * 1000:.0f} ms | {r['warm'] * 1000:.0f} ms "
              f"| {r['disk'] * 1000:.0f} ms | {r['restart'] * 1000:.0f} ms | {r['full'] / r['restart']:.0f}x "
              f"| {r['full'] / r['restart_restore']:.0f}x |")
    print()
    print("| N | restore (disk) | restore bandwidth | plain read | ratio | written per turn | new tokens' KV | ratio |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['n']} | {r['restart_restore'] * 1000:.1f} ms{'' if r['restart_cold'] else ' (page cache warm)'} "
              f"| {r['restore_mbps']:.0f} MB/s | {r['plain_mbps']:.0f} MB/s "
              f"| {r['restore_mbps'] / r['plain_mbps']:.0%} | {r['turn_written'] / 1e6:.2f} MB "
              f"| {r['turn_kv'] / 1e6:.2f} MB | {r['turn_written'] / r['turn_kv']:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
