"""The Triton backend: logits tiles live only in registers.

- ``forward_stats``: one program per [tokens x vocab] tile computes the float32 logits tile on the
  tensor cores and reduces it to per-token partial statistics; a small combine gives lse / entropy / zy.
- ``backward``: the vocabulary is walked in chunks; a Triton kernel recomputes each chunk's logits and
  writes its dlogits (input dtype), and cuBLAS turns them into d_hidden (float32, accumulated) and
  that chunk's rows of d_weight.
- ``backend``: the backend contract of ``logitless.ops.contract``.
"""
