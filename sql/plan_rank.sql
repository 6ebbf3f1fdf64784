-- The whole ranking of single blocks in one statement (window functions in subqueries only, portable
-- DuckDB/PostgreSQL). Operators with a joint sign election rank block rows instead (plan_rank_grouped.sql).
--
-- candidates (sql/plan_candidates.sql): every (expert, block) of the plan's tensors, scored, with its read cost.
-- ranked: deterministic order (score DESC NULLS LAST, tensor_idx, block_idx, position; candidates without
-- statistics rank last, in tensor order); running_cost is the cumulative read cost in that order, so the
-- access set for a budget B is the prefix running_cost <= B.
--
-- The result has two kinds of rows, sorted by kind, tensor_idx, position, block_idx:
--   kind 0, one per selected read: block_idx, nbytes (read cost), block_offset, xxh3;
--   kind 1, one per (tensor, expert) with candidates: nbytes = candidate bytes, n_blocks = candidates,
--           n_selected / selected_bytes of them in the access set, and the omitted-update bound terms
--           (block_idx -2, a LoRA factor, is a read unit, not an update: it adds nothing to the bound).
-- Nothing is pruned here (pruning is TIES's, which ranks block rows).
WITH /*include plan_candidates*/,
keyed AS MATERIALIZED (
    SELECT position, tensor_idx, block_idx, nbytes, block_offset, xxh3, score
    FROM candidates
    WHERE pruned = 0
),
-- The access set is a prefix of the ranking order, and so is C = {score >= T} for any T (NULL scores rank
-- last). Once C's bytes exceed the budget, every selected candidate is in C and running costs over C equal
-- those over all candidates, so only C is sorted. T comes from a histogram of the scores in log-scale buckets:
-- cum_bytes and cum_min are the bytes and smallest score of every bucket from the top down to this one, so
-- {score >= cum_min} holds at least cum_bytes (whatever LN's rounding); T is the cum_min of the highest bucket
-- whose cum_bytes exceed the budget, NULL (rank everything) where none does. NaN and inf scores (which sort
-- above every number) and scores too small for LN (zero) get buckets of their own.
hist AS (
    SELECT bucket, SUM(nbytes) AS bytes, MIN(score) AS min_key
    FROM (
        SELECT nbytes, score,
               CASE WHEN score > 1e300 THEN 1000000
                    WHEN score < 1e-300 THEN -1000000
                    ELSE CAST(FLOOR(LN(score) * 256) AS INTEGER) END AS bucket
        FROM keyed
        WHERE score IS NOT NULL
    ) k
    GROUP BY bucket
),
cut AS (
    SELECT MAX(cum_min) AS threshold
    FROM (
        SELECT SUM(bytes) OVER (ORDER BY bucket DESC ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS cum_bytes,
               MIN(min_key) OVER (ORDER BY bucket DESC ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS cum_min
        FROM hist
    ) c
    WHERE cum_bytes > :budget
),
running AS (
    SELECT position, tensor_idx, block_idx, nbytes, block_offset, xxh3, score,
           SUM(nbytes) OVER (
               ORDER BY score DESC NULLS LAST, tensor_idx, block_idx, position
               ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW
           ) AS running_cost
    FROM keyed CROSS JOIN cut
    WHERE cut.threshold IS NULL OR COALESCE(score >= cut.threshold, FALSE)
),
ranked AS MATERIALIZED (
    SELECT position, tensor_idx, block_idx, nbytes, block_offset, xxh3, score, CAST(running_cost AS BIGINT) AS running_cost
    FROM running
),
-- every candidate once: those of C with their running cost, the others (outside C: never selected)
everything AS (
    SELECT position, tensor_idx, block_idx, nbytes, score, CASE WHEN running_cost <= :budget THEN 1 ELSE 0 END AS selected
    FROM ranked
    UNION ALL
    SELECT position, tensor_idx, block_idx, nbytes, score, 0 AS selected
    FROM keyed CROSS JOIN cut
    WHERE NOT (cut.threshold IS NULL OR COALESCE(score >= cut.threshold, FALSE))
)
SELECT 0 AS kind, position, tensor_idx, block_idx, CAST(nbytes AS BIGINT) AS nbytes,
       CAST(block_offset AS BIGINT) AS block_offset, xxh3,
       CAST(NULL AS BIGINT) AS n_blocks, CAST(NULL AS BIGINT) AS n_selected, CAST(NULL AS BIGINT) AS selected_bytes,
       CAST(NULL AS DOUBLE PRECISION) AS omitted_score, CAST(NULL AS BIGINT) AS omitted_unscored
FROM ranked
WHERE running_cost <= :budget
UNION ALL
SELECT 1 AS kind, position, tensor_idx, CAST(NULL AS INTEGER) AS block_idx, CAST(SUM(nbytes) AS BIGINT) AS nbytes,
       CAST(NULL AS BIGINT) AS block_offset, CAST(NULL AS VARCHAR) AS xxh3,
       CAST(COUNT(*) AS BIGINT) AS n_blocks,
       CAST(SUM(selected) AS BIGINT) AS n_selected,
       CAST(SUM(CASE WHEN selected = 1 THEN nbytes ELSE 0 END) AS BIGINT) AS selected_bytes,
       CAST(SUM(CASE WHEN selected = 0 AND block_idx <> -2 THEN score ELSE 0 END) AS DOUBLE PRECISION)
           AS omitted_score,
       CAST(SUM(CASE WHEN selected = 0 AND score IS NULL THEN 1 ELSE 0 END) AS BIGINT) AS omitted_unscored
FROM everything
GROUP BY tensor_idx, position
ORDER BY kind, tensor_idx, position, block_idx
