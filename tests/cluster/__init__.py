"""Test harnesses that emulate a cluster on one machine (see netns.py)."""
