"""Catalog database: schema (source of truth), engine/session boundary, migrations."""
