CREATE VIEW refs AS
SELECT r.name, r.snapshot_id, r.version, r.updated_at
FROM mp_ref r
