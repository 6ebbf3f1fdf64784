CREATE TEMPORARY TABLE mp_plan_expert (
    position INTEGER NOT NULL,
    checkpoint_id VARCHAR(64) NOT NULL,
    coef DOUBLE PRECISION NOT NULL,
    tensor_level BOOLEAN NOT NULL
)
