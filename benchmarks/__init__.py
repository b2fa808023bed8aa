"""Benchmarks of stratagem against the hand-written PyTorch it replaces.

Every benchmark times stratagem (A) and the plain-PyTorch equivalent (B) in
the same process, interleaved round by round, and reports the per-round ratio
A / B. Run ``python -m benchmarks --help``.
"""
