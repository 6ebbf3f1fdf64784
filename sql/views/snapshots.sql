CREATE VIEW snapshots AS
SELECT s.id, s.ref, c.name AS checkpoint, s.state, s.method, s.plan_hash, s.budget_bytes, s.planned_bytes,
       s.realized_bytes, s.full_bytes, s.base_bytes, s.output_bytes, s.bound, s.seed, s.out_path, s.created_at
FROM mp_snapshot s
JOIN mp_checkpoint c ON c.id = s.checkpoint_id
WHERE s.state = 'COMMITTED'
