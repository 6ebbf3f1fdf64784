CREATE VIEW lineage AS
SELECT l.snapshot_id, ch.name AS child, p.name AS parent, l.role, l.position, p.kind AS parent_kind,
       s.method, s.budget_bytes, s.plan_hash
FROM mp_lineage l
JOIN mp_checkpoint ch ON ch.id = l.child_id
JOIN mp_checkpoint p ON p.id = l.parent_id
JOIN mp_snapshot s ON s.id = l.snapshot_id
