"""Torch-free code shared by every component: block hashes, protocol types, sampling params."""
