"""How many prompt tokens one model call processes (a prefill chunk): on the single path
(stream_generate) and in the batch (BatchGenerator) alike.

The model thread shows progress (Engine.beat) between chunks only, and the worker takes a runner
with work that shows none for EXO_RUNNER_STALL_S (30 s) for hung. mlx-lm's 2,048-token chunk can
outlast that where prompts are processed slowly (54 s for an 8-layer, hidden-512 model on a 2-core
CPU; 13 s at most in 512-token chunks, no slower in all: docs/benchmarks.md). A fixed step, rather
than one sized from a measured rate: the chunks, hence the numbers, are the same on every run and
on every rank of an instance (each chunk is a collective there), so output does not depend on timing.
"""

from __future__ import annotations

PREFILL_STEP = 512  # tokens a chunk, per prompt: a batch step prefills up to batch_steps.PREFILL_BATCH prompts
