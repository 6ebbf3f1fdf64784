-- Every candidate selected: the plan of a budget that holds the read cost of all of them (the planner runs this
-- first when the budget is at least the full read, checks the sum on the rows it returns, and derives the
-- per-(tensor, expert) summary from them: all selected, nothing omitted). One row per read, sorted as in
-- plan_rank.sql, without ranking anything.
WITH /*include plan_candidates*/
SELECT position, tensor_idx, block_idx, CAST(nbytes AS BIGINT) AS nbytes, CAST(block_offset AS BIGINT) AS block_offset,
       xxh3
FROM candidates
WHERE pruned = 0
ORDER BY tensor_idx, position, block_idx
