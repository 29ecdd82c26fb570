"""Shared by every stage: atomic files and locks, canonical JSON and digests, locations, the machine."""
