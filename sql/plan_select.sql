SELECT position, tensor_idx, block_idx, nbytes, block_offset, xxh3
FROM mp_plan_ranked
WHERE running_cost <= :budget
ORDER BY position, tensor_idx, block_idx
