-- The whole ranking of operators with a joint sign election (ties, dare_ties), in one statement.
--
-- Block rows are read units: the candidates of every expert for one (tensor, block) are read all together or
-- not at all, so no expert is dropped from an element's election and divisor while the others are kept. A
-- unit is scored by the sum of its candidates' scores and costs the sum of their read costs; a LoRA factor
-- (block_idx -2) is a unit of its own (member = its expert), ranked first, so a selected block always has its
-- factor. Units are ranked (factors first, then score DESC NULLS LAST, tensor_idx, block_idx, member) and the
-- access set is every candidate of the units whose running cost fits :budget. The units are aggregated before
-- they are ranked: ~1/K as many rows to sort as candidates.
--
-- pool carries `member` (-3 for pruned candidates, which are in no unit) so that the join with the chosen
-- units needs no other filter: PostgreSQL estimates a filtered CTE at 0.5 % of its rows, and then sorts all
-- of them for a merge join instead of hashing the few chosen units.
--
-- Rows, sorted by kind, tensor_idx, position, block_idx:
--   kind 0, one per selected read: block_idx, nbytes (read cost), block_offset, xxh3;
--   kind 1, one per (tensor, expert) with ranked candidates: n_blocks candidates, nbytes their read cost;
--   kind 2, the same for the pruned candidates (delta_max < prune_below: every element trims to zero).
-- The planner derives the plan summary (selected counts and bytes per (tensor, expert)) from kinds 0 and 1.
-- Scores are not summed per (tensor, expert): these operators are not additive, and have no omitted-update
-- bound.
WITH /*include plan_candidates*/,
pool AS MATERIALIZED (
    SELECT position, tensor_idx, block_idx, nbytes, block_offset, xxh3, score, pruned,
           CASE WHEN pruned = 1 THEN -3 WHEN block_idx = -2 THEN position ELSE -1 END AS member
    FROM candidates
),
units AS (
    SELECT tensor_idx, block_idx, member, CASE WHEN block_idx = -2 THEN NULL ELSE SUM(score) END AS rank_key,
           SUM(nbytes) AS cost
    FROM pool
    WHERE member <> -3
    GROUP BY tensor_idx, block_idx, member
),
chosen AS MATERIALIZED (
    SELECT tensor_idx, block_idx, member
    FROM (
        SELECT tensor_idx, block_idx, member,
               SUM(cost) OVER (ORDER BY CASE WHEN block_idx = -2 THEN 0 ELSE 1 END, rank_key DESC NULLS LAST,
                                        tensor_idx, block_idx, member
                               ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS running_cost
        FROM units
    ) r
    WHERE running_cost <= :budget
)
SELECT 0 AS kind, p.position, p.tensor_idx, p.block_idx, CAST(p.nbytes AS BIGINT) AS nbytes,
       CAST(p.block_offset AS BIGINT) AS block_offset, p.xxh3, CAST(NULL AS BIGINT) AS n_blocks
FROM pool p
JOIN chosen c ON c.tensor_idx = p.tensor_idx AND c.block_idx = p.block_idx AND c.member = p.member
UNION ALL
SELECT 1 + pruned AS kind, position, tensor_idx, CAST(NULL AS INTEGER) AS block_idx,
       CAST(SUM(nbytes) AS BIGINT) AS nbytes, CAST(NULL AS BIGINT) AS block_offset, CAST(NULL AS VARCHAR) AS xxh3,
       CAST(COUNT(*) AS BIGINT) AS n_blocks
FROM pool
GROUP BY tensor_idx, position, pruned
ORDER BY kind, tensor_idx, position, block_idx
