"""verispec: lossless speculative decoding.

A drafter proposes tokens, the target verifies them all in one forward pass, and a rejection sampler
commits a prefix plus one recovered or bonus token so that the output distribution is exactly the
target's. docs/architecture.md has the module map; docs/algorithms.md the algorithms.
"""

__version__ = "0.1.0"
