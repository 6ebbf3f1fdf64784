-- Ranking summary of one checkpoint's blocks, per tensor (mergepipe_db/ranking.py): its candidates (delta_l2
-- NULL or non-zero), their bytes, the unscored ones (NULL), and the sum of delta_l2 over the scored ones.
INSERT INTO mp_rank_tensor (checkpoint_id, tensor_idx, candidates, candidate_bytes, unscored, l2_sum)
SELECT checkpoint_id, tensor_idx, COUNT(*), SUM(nbytes), SUM(CASE WHEN delta_l2 IS NULL THEN 1 ELSE 0 END),
       SUM(delta_l2)
FROM mp_block
WHERE checkpoint_id = :checkpoint_id AND (delta_l2 IS NULL OR delta_l2 <> 0)
GROUP BY checkpoint_id, tensor_idx
