"""Golden merges: a fixed set of small deterministic merges whose hashes are recorded in golden.json.

`cases.py` builds them (used by `record.py` and by tests/integration/test_golden.py); re-record with
``python -m tests.golden.record`` only when a change of merge output is intended.
"""
