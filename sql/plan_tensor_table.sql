-- The tensors each expert contributes to the merge: arithmetic dtype and present in the base. tensor_idx is
-- the expert's own index, base_idx the base's (matched by name in Python, so no name join in SQL).
-- prune_below: a TIES trim bound (NULL: none); a block with delta_max < prune_below is trimmed to zero.
-- coef: this tensor's ranking coefficient where parameters are resolved per tensor (NULL: the expert's).
CREATE TEMPORARY TABLE mp_plan_tensor (
    position INTEGER NOT NULL,
    tensor_idx INTEGER NOT NULL,
    base_idx INTEGER NOT NULL,
    prune_below DOUBLE PRECISION,
    coef DOUBLE PRECISION
)
