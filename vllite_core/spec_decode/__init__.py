"""Speculative decoding: proposers draft tokens, the target verifies them by rejection sampling."""
