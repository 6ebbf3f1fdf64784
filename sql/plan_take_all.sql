-- Every candidate selected: the plan of a budget that holds the read cost of all of them (planner.build_plan
-- runs this first when the budget is at least the full read, and checks the sum on the rows it returns). Rows
-- and columns as plan_rank.sql gives them for such a budget, without ranking anything: kind 0, one per read;
-- kind 1, one per (tensor, expert) with candidates, all selected, nothing omitted.
WITH /*include plan_candidates*/,
taken AS MATERIALIZED (
    SELECT position, tensor_idx, block_idx, nbytes, block_offset, xxh3
    FROM candidates
    WHERE pruned = 0
)
SELECT 0 AS kind, position, tensor_idx, block_idx, CAST(nbytes AS BIGINT) AS nbytes,
       CAST(block_offset AS BIGINT) AS block_offset, xxh3,
       CAST(NULL AS BIGINT) AS n_blocks, CAST(NULL AS BIGINT) AS n_selected, CAST(NULL AS BIGINT) AS selected_bytes,
       CAST(NULL AS DOUBLE PRECISION) AS omitted_score, CAST(NULL AS BIGINT) AS omitted_unscored
FROM taken
UNION ALL
SELECT 1 AS kind, position, tensor_idx, CAST(NULL AS INTEGER) AS block_idx, CAST(SUM(nbytes) AS BIGINT) AS nbytes,
       CAST(NULL AS BIGINT) AS block_offset, CAST(NULL AS VARCHAR) AS xxh3,
       CAST(COUNT(*) AS BIGINT) AS n_blocks, CAST(COUNT(*) AS BIGINT) AS n_selected,
       CAST(SUM(nbytes) AS BIGINT) AS selected_bytes, CAST(0 AS DOUBLE PRECISION) AS omitted_score,
       CAST(0 AS BIGINT) AS omitted_unscored
FROM taken
GROUP BY tensor_idx, position
ORDER BY kind, tensor_idx, position, block_idx
