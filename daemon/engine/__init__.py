"""The engine: one thread that owns the model and every MLX array.

thread (the engine loop), jobs (its inbox), scheduler (admission and prefill order, pure), prefill and running
(a turn's prefill and decode), quantized (kv_bits caches), modelload (the model onto this thread), budgets
(its cache store in the budgets every model shares), heap (glibc's malloc tuned on the CPU);
speculative decoding: speculate (drafts verified in the batch's forward, rolled back per row), draft (prompt
lookup, draft sizes), verify (the exact accept rules).
"""
