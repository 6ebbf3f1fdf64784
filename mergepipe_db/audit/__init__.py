"""Audit: lineage, reports and budget sweeps."""
