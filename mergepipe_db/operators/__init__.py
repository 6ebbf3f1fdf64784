"""Merge operators: pure tensor math on one tensor's blocks (no I/O)."""
