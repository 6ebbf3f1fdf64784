CREATE VIEW checkpoints AS
SELECT c.id, c.name, c.kind, b.name AS base, c.root, c.n_tensors, c.total_bytes, c.block_bytes,
       c.has_stats, c.created_at, c.tool_version, c.config
FROM mp_checkpoint c
LEFT JOIN mp_checkpoint b ON b.id = c.base_id
