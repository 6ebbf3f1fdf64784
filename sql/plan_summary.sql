-- Per (tensor, expert): candidates, their bytes, the planned bytes and the omitted-update bound terms.
-- block_idx -2 is a LoRA adapter's shared factor: a read unit, not an update, so it adds nothing to the bound.
SELECT tensor_idx, position,
       COUNT(*) AS candidates,
       SUM(nbytes) AS candidate_bytes,
       SUM(CASE WHEN running_cost <= :budget THEN 1 ELSE 0 END) AS selected,
       SUM(CASE WHEN running_cost <= :budget THEN nbytes ELSE 0 END) AS planned_bytes,
       SUM(CASE WHEN running_cost > :budget AND block_idx <> -2 THEN score ELSE 0 END) AS omitted_score,
       SUM(CASE WHEN running_cost > :budget AND score IS NULL THEN 1 ELSE 0 END) AS omitted_unscored
FROM mp_plan_ranked
GROUP BY tensor_idx, position
ORDER BY tensor_idx, position
