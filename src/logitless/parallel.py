"""Vocab-parallel and sequence-parallel maths (tensor-parallel groups)."""
from __future__ import annotations


class VocabParallel:
    @classmethod
    def for_group(cls, group, weight):
        raise NotImplementedError("tp_group is not supported yet")
