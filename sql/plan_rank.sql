-- Every candidate (expert, block) — or (expert, whole tensor) for experts planned at tensor level — scored
-- |c_k| * ||delta||_2, ranked with deterministic tie-breaks; running_cost is the cumulative read cost in
-- rank order, so the access set for a budget B is the prefix running_cost <= B.
-- Blocks whose delta is exactly zero (delta_l2 = 0, e.g. bytes equal to the base's) are never candidates.
-- tensor_idx is the base's (checkpoint order); experts are matched to it by tensor name.
-- Candidates without statistics (score NULL) rank last, in tensor order.
-- A block held in the packed store (mp_packed_block) costs its compressed length. A LoRA adapter's shared
-- factor is block_idx -2 with the max delta_l2 of its tensor's blocks, so it ranks just before them.
CREATE TEMPORARY TABLE mp_plan_ranked AS
SELECT position, tensor_idx, block_idx, nbytes, block_offset, xxh3, score,
       SUM(nbytes) OVER (
           ORDER BY score DESC NULLS LAST, tensor_idx, block_idx, position
           ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW
       ) AS running_cost
FROM (
    SELECT e.position, bt.tensor_idx, b.block_idx, COALESCE(pk.clen, b.nbytes) AS nbytes,
           b."offset" AS block_offset, b.xxh3, e.coef * b.delta_l2 AS score
    FROM mp_plan_expert e
    JOIN mp_block b ON b.checkpoint_id = e.checkpoint_id
    LEFT JOIN mp_packed_block pk ON pk.checkpoint_id = b.checkpoint_id AND pk.tensor_idx = b.tensor_idx
                                AND pk.block_idx = b.block_idx
    JOIN mp_tensor t ON t.checkpoint_id = b.checkpoint_id AND t.tensor_idx = b.tensor_idx
    JOIN mp_tensor bt ON bt.checkpoint_id = :base_id AND bt.name = t.name
    WHERE NOT e.tensor_level
      AND t.dtype IN ('F32', 'F16', 'BF16')
      AND (b.delta_l2 IS NULL OR b.delta_l2 <> 0)
    UNION ALL
    SELECT e.position, bt.tensor_idx, -1 AS block_idx, t.nbytes, t."offset" AS block_offset, t.xxh3,
           e.coef * t.delta_l2 AS score
    FROM mp_plan_expert e
    JOIN mp_tensor t ON t.checkpoint_id = e.checkpoint_id
    JOIN mp_tensor bt ON bt.checkpoint_id = :base_id AND bt.name = t.name
    WHERE e.tensor_level
      AND t.dtype IN ('F32', 'F16', 'BF16')
      AND (t.delta_l2 IS NULL OR t.delta_l2 <> 0)
) candidates
