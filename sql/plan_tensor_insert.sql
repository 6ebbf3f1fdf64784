-- One row per (expert, tensor), passed as parallel arrays: one statement for thousands of rows.
INSERT INTO mp_plan_tensor (position, tensor_idx, base_idx, prune_below, coef)
SELECT UNNEST(CAST(:position AS INTEGER[])), UNNEST(CAST(:tensor_idx AS INTEGER[])),
       UNNEST(CAST(:base_idx AS INTEGER[])), UNNEST(CAST(:prune_below AS DOUBLE PRECISION[])),
       UNNEST(CAST(:coef AS DOUBLE PRECISION[]))
