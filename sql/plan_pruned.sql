-- TIES pruning: per (tensor, expert), the candidates with delta_max < prune_below (every element trims to zero;
-- plan_take_all.sql leaves them out) and their read cost. tensor_idx is the base's. Run beside a take-all plan;
-- plan_rank_grouped.sql counts them itself.
WITH /*include plan_candidates*/
SELECT tensor_idx, position, COUNT(*) AS n_blocks, CAST(SUM(nbytes) AS BIGINT) AS nbytes
FROM candidates
WHERE pruned = 1
GROUP BY tensor_idx, position
ORDER BY tensor_idx, position
