"""logitless: per-token log-probabilities and entropy straight from hidden states and the LM head,
forward and backward, without building the [tokens x vocab] logits tensor."""
from .api import BACKENDS, TokenLogProbs, choose_backend, fused_logprobs, last_backend, last_precision
from .topk import TopKLogProbs, fused_topk
from .truncation import TruncatedLogProbs, Truncation

__all__ = ["fused_logprobs", "TokenLogProbs", "fused_topk", "TopKLogProbs", "Truncation",
           "TruncatedLogProbs", "last_backend", "last_precision",
           "choose_backend", "BACKENDS"]
__version__ = "0.1.0"
