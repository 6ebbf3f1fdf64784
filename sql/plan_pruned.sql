-- TIES pruning: per (tensor, expert), the nonzero-delta blocks with delta_max < prune_below (every element
-- trims to zero; see plan_rank.sql, which leaves them out) and their read cost. tensor_idx is the base's.
SELECT pt.base_idx AS tensor_idx, e.position, COUNT(*) AS n_blocks,
       CAST(SUM(COALESCE(pk.clen, b.nbytes)) AS BIGINT) AS nbytes
FROM mp_plan_expert e
JOIN mp_plan_tensor pt ON pt.position = e.position
JOIN mp_block b ON b.checkpoint_id = e.checkpoint_id AND b.tensor_idx = pt.tensor_idx
LEFT JOIN mp_packed_block pk ON pk.checkpoint_id = b.checkpoint_id AND pk.tensor_idx = b.tensor_idx
                            AND pk.block_idx = b.block_idx
WHERE NOT e.tensor_level
  AND pt.prune_below IS NOT NULL
  AND (b.delta_l2 IS NULL OR b.delta_l2 <> 0)
  AND b.delta_max < pt.prune_below
GROUP BY pt.base_idx, e.position
ORDER BY pt.base_idx, e.position
