CREATE VIEW blocks AS
SELECT c.name AS checkpoint, t.name AS tensor, b.tensor_idx, b.block_idx, b.row_start, b.row_stop,
       b."offset", b.nbytes, b.xxh3, b.delta_l2, b.delta_l1, b.delta_max, b.pos_frac
FROM mp_block b
JOIN mp_checkpoint c ON c.id = b.checkpoint_id
JOIN mp_tensor t ON t.checkpoint_id = b.checkpoint_id AND t.tensor_idx = b.tensor_idx
