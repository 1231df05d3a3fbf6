"""PENDING: a token whose id is not known yet where it is written, the one sentinel for it.

A plan made ahead of the running step asks memsvc for a slot for the token that step
samples (memsvc keys no block by it until a later plan's `fills` names it: pagedserve.memsvc.allocator
`fill`); the step message computes that token as PENDING, and the executor puts its own
last sample in its place (pagedserve.wire.step_feed). See docs/ARCHITECTURE.md, "The step path".
"""

PENDING = -1  # no real token id is negative
