CREATE VIEW reads AS
SELECT r.snapshot_id, e.name AS expert, r.position, t.name AS tensor, r.tensor_idx, r.blocks_total,
       r.blocks_read, r.bytes_full, r.bytes_planned, r.bytes_read
FROM mp_read r
JOIN mp_checkpoint e ON e.id = r.expert_id
JOIN mp_snapshot s ON s.id = r.snapshot_id
JOIN mp_checkpoint o ON o.id = s.checkpoint_id
JOIN mp_tensor t ON t.checkpoint_id = o.id AND t.tensor_idx = r.tensor_idx
