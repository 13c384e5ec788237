"""Verifiers: rejection samplers that commit a prefix of the drafts plus one recovered or bonus token."""

from verispec.verify.chain import ChainResult, verify_chain, verify_chain_batch, verify_chain_greedy

__all__ = ["ChainResult", "verify_chain", "verify_chain_batch", "verify_chain_greedy"]
