-- One row per expert, passed as parallel arrays (one statement, whatever the number of experts).
INSERT INTO mp_plan_expert (position, checkpoint_id, coef, tensor_level, packed, score_floor)
SELECT UNNEST(CAST(:position AS INTEGER[])), UNNEST(CAST(:checkpoint_id AS VARCHAR(64)[])),
       UNNEST(CAST(:coef AS DOUBLE PRECISION[])), UNNEST(CAST(:tensor_level AS BOOLEAN[])),
       UNNEST(CAST(:packed AS BOOLEAN[])),
       UNNEST(CAST(:score_floor AS DOUBLE PRECISION[]))
