INSERT INTO mp_plan_expert (position, checkpoint_id, coef, tensor_level)
VALUES (:position, :checkpoint_id, :coef, :tensor_level)
