-- One row per expert of the merge. packed: the expert has blocks in the packed store (they cost their compressed
-- length, plan_candidates.sql). score_floor: a lower bound on the delta_l2 of every block of this expert in
-- the top of the ranking that plan_rank_top.sql reads (NULL where the plan ranks every candidate instead).
CREATE TEMPORARY TABLE mp_plan_expert (
    position INTEGER NOT NULL,
    checkpoint_id VARCHAR(64) NOT NULL,
    coef DOUBLE PRECISION NOT NULL,
    tensor_level BOOLEAN NOT NULL,
    packed BOOLEAN NOT NULL,
    score_floor DOUBLE PRECISION
)
