CREATE VIEW tensors AS
SELECT c.name AS checkpoint, t.tensor_idx, t.name, t.dtype, t.shape, f.relpath AS file, t."offset",
       t.nbytes, t.n_rows, t.rows_per_block, t.n_blocks, t.xxh3, t.delta_l2, t.equal_to_base
FROM mp_tensor t
JOIN mp_checkpoint c ON c.id = t.checkpoint_id
JOIN mp_file f ON f.id = t.file_id
