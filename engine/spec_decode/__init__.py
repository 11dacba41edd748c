"""Speculative decoding: proposers (n-gram, draft model, self-draft), exact verification, adaptive control."""
