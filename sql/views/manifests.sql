CREATE VIEW manifests AS
SELECT m.snapshot_id, m.manifest, m.timings
FROM mp_manifest m
JOIN mp_snapshot s ON s.id = m.snapshot_id
WHERE s.state = 'COMMITTED'
