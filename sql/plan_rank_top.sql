-- The top of the ranking: the candidates scoring at least :threshold (the set C of mergepipe_db/ranking.py,
-- which holds more than :budget bytes), ranked as plan_rank.sql ranks them single-block (grouped = 0) (score DESC,
-- tensor_idx, block_idx, position), and the prefix whose running cost fits :budget. Used for single-block
-- ranking of full, delta and snapshot experts with block statistics, nothing packed and nothing pruned.
-- Each expert's candidates are an index range (delta_l2 >= score_floor, a bound a few ulps below
-- threshold / coef) filtered exactly (coef * delta_l2 >= threshold, the score as plan_rank.sql computes it);
-- OFFSET 0 keeps that range scan, and the join that maps the expert's tensors to the base's, per expert
-- (PostgreSQL would otherwise hash all of mp_block, or all experts' tensors).
--
-- One row per selected read (with its score: the planner sums the selected scores for the omitted-update bound),
-- and the first candidate past the budget, if any (running_cost > :budget): its presence shows C holds more than
-- the budget, which the planner checks. Rows come in no particular order: the planner sorts the reads by
-- tensor_idx, position, block_idx.
WITH ranked AS (
    SELECT position, tensor_idx, block_idx, nbytes, block_offset, xxh3, score,
           SUM(nbytes) OVER (ORDER BY score DESC, tensor_idx, block_idx, position
                             ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS running_cost
    FROM (
        SELECT e.position, b.base_idx AS tensor_idx, b.block_idx, b.nbytes, b.block_offset, b.xxh3,
               e.coef * b.delta_l2 AS score
        FROM mp_plan_expert e
        CROSS JOIN LATERAL (
            SELECT pt.base_idx, mb.block_idx, mb.nbytes, mb."offset" AS block_offset, mb.xxh3, mb.delta_l2
            FROM mp_block mb
            JOIN mp_plan_tensor pt ON pt.position = e.position AND pt.tensor_idx = mb.tensor_idx
            WHERE mb.checkpoint_id = e.checkpoint_id AND mb.delta_l2 >= e.score_floor
            OFFSET 0
        ) b
        WHERE e.coef * b.delta_l2 >= :threshold
    ) top
)
SELECT position, tensor_idx, block_idx, CAST(nbytes AS BIGINT) AS nbytes, CAST(block_offset AS BIGINT) AS block_offset,
       xxh3, score, CAST(running_cost AS BIGINT) AS running_cost
FROM ranked
WHERE running_cost - nbytes <= :budget
