"""Core: the plain data objects that pass between pipeline stages (plan, reads, results, spec, manifest), and
the tables and rules every layer shares (dtypes, block geometry, the sketch, hashing, names). Imports only
`mergepipe_db.errors`."""
