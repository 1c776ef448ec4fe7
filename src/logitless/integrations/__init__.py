"""Integrations of ``logitless.fused_logprobs`` into model frameworks.

Each integration calls only the public op and the helpers of ``logitless.parallel``; none reaches
into a backend. Framework imports happen lazily, so importing this package needs only torch.
"""
