"""Decoding: sampling parameters, draft trees, verification, proposers and the decode loop."""
