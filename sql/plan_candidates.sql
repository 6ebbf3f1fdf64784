-- A fragment, not a statement: the `candidates` CTE of plan_rank.sql, plan_rank_grouped.sql, plan_take_all.sql
-- and plan_pruned.sql, which include it by name (resources.sql_text).
--
-- candidates: every (expert, block) — or (expert, whole tensor) for experts planned at tensor level — of the
-- tensors in mp_plan_tensor, scored |c_k| * ||delta||_2, with tensor_idx the base's. Blocks whose delta is
-- exactly zero (delta_l2 = 0, e.g. bytes equal to the base's) are never candidates; a whole tensor is one
-- still if its bytes differ from the base's (equal_to_base false: only in the sign of some zeros), since
-- slerp, the operator planned at tensor level, reads θ_k itself and gives +0.0 and -0.0 apart; a block with
-- delta_max < prune_below (TIES: every element is below the trim threshold) is `pruned`, and not ranked either.
-- A block held in the packed store (mp_packed_block) costs its compressed length where that is smaller than the
-- block (the others are read from the expert's file, `blockstore.load_index`): only the experts marked
-- `packed` are joined with the store (a join per block row costs PostgreSQL ~0.1 s per 10^6 candidates, even
-- with an empty store). A LoRA adapter's shared factor is block_idx -2 with the max delta_l2 of its tensor's
-- blocks, so it ranks just before them.
candidates AS (
    SELECT e.position, pt.base_idx AS tensor_idx, b.block_idx, b.nbytes, b."offset" AS block_offset, b.xxh3,
           COALESCE(pt.coef, e.coef) * b.delta_l2 AS score, CASE WHEN b.delta_max < pt.prune_below THEN 1 ELSE 0 END AS pruned
    FROM mp_plan_expert e
    JOIN mp_plan_tensor pt ON pt.position = e.position
    JOIN mp_block b ON b.checkpoint_id = e.checkpoint_id AND b.tensor_idx = pt.tensor_idx
    WHERE NOT e.tensor_level AND NOT e.packed
      AND (b.delta_l2 IS NULL OR b.delta_l2 <> 0)
    UNION ALL
    SELECT e.position, pt.base_idx AS tensor_idx, b.block_idx, COALESCE(pk.clen, b.nbytes) AS nbytes,
           b."offset" AS block_offset, b.xxh3, COALESCE(pt.coef, e.coef) * b.delta_l2 AS score,
           CASE WHEN b.delta_max < pt.prune_below THEN 1 ELSE 0 END AS pruned
    FROM mp_plan_expert e
    JOIN mp_plan_tensor pt ON pt.position = e.position
    JOIN mp_block b ON b.checkpoint_id = e.checkpoint_id AND b.tensor_idx = pt.tensor_idx
    LEFT JOIN mp_packed_block pk ON pk.checkpoint_id = b.checkpoint_id AND pk.tensor_idx = b.tensor_idx
                                AND pk.block_idx = b.block_idx AND pk.clen < b.nbytes
    WHERE NOT e.tensor_level AND e.packed
      AND (b.delta_l2 IS NULL OR b.delta_l2 <> 0)
    UNION ALL
    SELECT e.position, pt.base_idx AS tensor_idx, -1 AS block_idx, t.nbytes, t."offset" AS block_offset, t.xxh3,
           COALESCE(pt.coef, e.coef) * t.delta_l2 AS score, 0 AS pruned
    FROM mp_plan_expert e
    JOIN mp_plan_tensor pt ON pt.position = e.position
    JOIN mp_tensor t ON t.checkpoint_id = e.checkpoint_id AND t.tensor_idx = pt.tensor_idx
    WHERE e.tensor_level
      AND (t.delta_l2 IS NULL OR t.delta_l2 <> 0 OR NOT t.equal_to_base)
)
