"""The pipeline stages: ingest, plan, execute, commit, replay. Each takes and returns core objects; no stage
imports another (`make lint`)."""
